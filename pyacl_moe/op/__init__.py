"""The generic op layer and one module per operator.

- :mod:`.spec` - an operator's slots: inputs, outputs and attributes in C order.
- :mod:`.executor` - the two phases of any operator; Executor.
- :mod:`.plan` - prepared launches (Plan) and the per-stream executor cache.
- :mod:`.moe_init_routing_v2_grad` - aclnnMoeInitRoutingV2Grad.
"""
