"""The fuzz tests' worker: runs cases through the binding in its own process, so that a crash
(a segmentation fault, say) fails one example instead of killing pytest.

Protocol on stdin/stdout: a 4-byte big-endian length, then a pickled request; the reply is
framed the same way. Request: dict(x, idx, top_k, drop_pad_mode, active_num, validate, device,
stream): ``device`` passes DeviceArrays, ``stream`` queues everything on a stream of its own
(else the default stream). Reply: ("ok", ndarray) or ("error", exception type name, message,
whether it is one of pyacl_moe's deliberate errors: InvalidArgument or AclError). A request
with op="forward" runs the forward op instead (see _forward).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from contextlib import closing


def _read(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return pickle.loads(stream.read(n))


def _write(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _forward(pm, req):
    """The forward: request dict(op="forward", x, idx, attrs (the six attributes in C order),
    validate, device, stream); reply ("ok", tuple of the four outputs, None where absent)."""
    try:
        if req["device"]:
            with closing(pm.Stream()) as s:
                x, idx = pm.to_device(req["x"], stream=s), pm.to_device(req["idx"], stream=s)
                r = pm.moe_init_routing_v2(x, idx, *req["attrs"], stream=s, validate=req["validate"])
                outs = tuple(None if a is None else a.to_host(s) for a in r)
        else:
            outs = tuple(pm.moe_init_routing_v2(req["x"], req["idx"], *req["attrs"], validate=req["validate"]))
        return ("ok", outs)
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc), isinstance(exc, (pm.InvalidArgument, pm.AclError)))


def main() -> None:
    os.environ.setdefault("PYACL_MOE_EMULATOR", "1")
    import pyacl_moe as pm

    dev = pm.Device(0)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        if dev.fault is not None:  # a case that faulted the device: sticky until a reset
            dev.reset()
        req = _read(inp)
        if req is None:
            return
        if req.get("op") == "forward":
            _write(out, _forward(pm, req))
            continue
        try:
            args = (req["x"], req["idx"], req["top_k"], req["drop_pad_mode"], req["active_num"])
            if req["device"] and req.get("stream"):
                with closing(pm.Stream()) as s:
                    x, idx = pm.to_device(args[0], stream=s), pm.to_device(args[1], stream=s)
                    res = pm.moe_init_routing_v2_grad(x, idx, *args[2:], stream=s, validate=req["validate"]).to_host(s)
            elif req["device"]:
                x, idx = pm.to_device(args[0]), pm.to_device(args[1])
                res = pm.moe_init_routing_v2_grad(x, idx, *args[2:], validate=req["validate"]).to_host()
            else:
                res = pm.moe_init_routing_v2_grad(*args, validate=req["validate"])
            reply = ("ok", res)
        except Exception as exc:
            reply = ("error", type(exc).__name__, str(exc), isinstance(exc, (pm.InvalidArgument, pm.AclError)))
        _write(out, reply)


if __name__ == "__main__":
    main()
