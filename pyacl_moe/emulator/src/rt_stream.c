/*
 * Emulated libascendcl.so, streams and events, and the device engine that runs their tasks.
 *
 * A stream is a FIFO of tasks that finish in order. Two modes (aclemuSetStreamMode,
 * PYACL_MOE_EMU_STREAMS):
 *  - async (default): a background engine thread, started on first need, runs the queued tasks
 *    of every stream, a batch at a time, round robin over the streams that have work. A thread
 *    that waits for a stream (synchronize, event, destroy, reset) helps: it runs the stream's
 *    next task itself whenever no other thread is running that stream, so waiting is never
 *    slower than in lazy mode. A stream holds at most g_queue_depth tasks; an enqueue on a full
 *    stream waits for room (helping too), as a hardware task queue makes the host wait.
 *  - lazy: no engine; tasks run only on threads that wait for them, so a test sees queued work
 *    deterministically. No bound on the queue.
 *
 * A task that waits for an event (aclrtStreamWaitEvent) is never run before the record it
 * names has run: a stream whose head is such a wait is blocked. A thread that needs a blocked
 * stream to progress walks the chain of waits iteratively, with a path on the heap (never by
 * recursion on the C stack: a chain of thousands of streams is legal), runs the first task it
 * finds that can run, and walks again. Waits only name records queued before them, so the
 * tasks form a DAG in queue order and the helpers cannot deadlock.
 *
 * Launch cost: the engine is signalled only when it sleeps for good; a busy or napping engine
 * finds new work on the ready list at its next pick, with no system call on the launching
 * thread, and takes up to EMU_ENGINE_BATCH tasks of a stream under one lock.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rt_internal.h"

/* ------------------------------------------------------------------ engine state */

__thread int32_t g_task_device = -1;

static pthread_t g_engine_thread;
static int g_engine_started;   /* a thread of generation g_engine_gen exists */
static unsigned g_engine_gen;  /* bumped to tell the current engine thread to exit */
static int g_engine_sleeping;  /* 1: napping (timed, not signalled), 2: asleep until signalled */
static int g_engine_busy;      /* running a task */
static emu_stream *g_ready_head, *g_ready_tail; /* streams with work for the engine */

/* When the engine runs out of work it naps: a short timed wait nobody signals, so a burst of
 * launches costs the launching thread no system call and the engine finds the tasks queued
 * meanwhile in one batch. After EMU_ENGINE_NAPS naps without work it sleeps until signalled
 * (g_engine_sleeping 2), and only then does an enqueue signal it. Spinning instead would keep
 * a CPU busy that the launching thread or the kernel may need. */
#define EMU_ENGINE_NAP_US 200
#define EMU_ENGINE_NAPS 10

static void ready_push_locked(emu_stream *s) {
    if (s->in_ready) return;
    s->in_ready = 1;
    s->refs++; /* the list keeps the stream alive */
    s->ready_next = NULL;
    if (g_ready_tail) g_ready_tail->ready_next = s;
    else g_ready_head = s;
    g_ready_tail = s;
}

static emu_stream *ready_pop_locked(void) {
    emu_stream *s = g_ready_head;
    if (!s) return NULL;
    g_ready_head = s->ready_next;
    if (!g_ready_head) g_ready_tail = NULL;
    s->in_ready = 0;
    s->ready_next = NULL;
    return s; /* the caller owns the list's reference */
}

static void ready_clear_locked(void) {
    emu_stream *s;
    while ((s = ready_pop_locked())) stream_unref_locked(s);
}

static void *engine_main(void *arg);
static void engine_stop_locked(void);

/* Before this library is unloaded (at the process's exit, or a dlclose) the engine thread stops
 * (joined), whoever did or did not call aclFinalize: a thread still running, or napping in a
 * timed wait, in code being unmapped crashes the exit. A destructor, not atexit(): a sanitizer's
 * atexit keeps no note of the library, and would call it after the unmapping. The lock is tried,
 * not waited for: a thread that holds it then keeps the engine as it is. */
__attribute__((destructor)) static void engine_at_exit(void) {
    for (int tries = 0; tries < 1000; tries++) {
        if (pthread_mutex_trylock(&g_lock) == 0) {
            engine_stop_locked();
            pthread_mutex_unlock(&g_lock);
            return;
        }
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
}

/* Make sure the engine will look at the ready list: start it, or wake it if it sleeps. */
static void engine_kick_locked(void) {
    if (g_engine_sleeping == 2) {
        pthread_cond_signal(&g_engine_cond);
        return;
    }
    if (g_engine_started) return; /* busy: it picks the work up by itself */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the application's threads */
    int r = pthread_create(&g_engine_thread, NULL, engine_main, (void *)(uintptr_t)g_engine_gen);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    /* Without a thread the work still runs, lazily, on the threads that wait for it. */
    if (r == 0) g_engine_started = 1;
}

/* Hand a stream to the engine if it has work nobody is running. */
static void settle_locked(emu_stream *s) {
    if (!g_async || !s->head || s->running) return;
    ready_push_locked(s);
    engine_kick_locked();
}

/* Latch a task's fault on its stream, as CANN stores a failed task's code on its stream
 * (Stream::SetErrCode, stream.hpp; davinci_kernel_task.cc, task_manager.cc): unconditionally, so
 * a later fault overwrites an earlier one not yet reported (the latest wins; the vendor's FAQ,
 * docs/04_FAQ/如何获取和解读Runtime异步错误码.md, says the same of continue-on-failure mode).
 * Later tasks still run. How many faulted is kept for the message only. */
static void latch_fault_locked(emu_stream *s, int status, const char *msg) {
    count_add(EMU_C_DEVICE_FAULTS, 1);
    s->pending_faults++;
    s->pending_status = status;
    snprintf(s->pending_msg, sizeof s->pending_msg, "%s", msg);
}

/* Run s's head task on this thread. Lock held on entry and exit, released while the task
 * runs; the caller holds a reference on s and has checked that s has a head and is not
 * running. */
static void run_head_locked(emu_stream *s) {
    emu_task *t = s->head;
    s->head = t->next;
    if (!s->head) s->tail = NULL;
    s->running = 1;
    pthread_mutex_unlock(&g_lock);
    char msg[EMU_MSG_LEN];
    msg[0] = 0;
    g_task_device = s->device;
    int st = t->run ? t->run(t->payload, msg, sizeof msg) : 0;
    g_task_device = -1;
    pthread_mutex_lock(&g_lock);
    s->running = 0;
    s->done_seq = t->seq;
    count_add(EMU_C_PENDING_TASKS, -1);
    if (st) latch_fault_locked(s, st, msg);
    if (t->release) t->release(t->payload);
    free(t);
    if (g_waiters) pthread_cond_broadcast(&g_cond);
}

typedef struct wait_payload {
    emu_stream *target;
    uint64_t seq;
} wait_payload;

/* A wait task does nothing when run: it runs only once the record it names has run. */
static int wait_run(void *p, char *msg, size_t len) {
    (void)p;
    (void)msg;
    (void)len;
    return 0;
}

/* The stream (and position in it) that s's head task waits for, or NULL when the head can run. */
static emu_stream *blocked_on_locked(const emu_stream *s, uint64_t *seq) {
    const emu_task *t = s->head;
    if (!t || t->run != wait_run) return NULL;
    const wait_payload *w = t->payload;
    if (w->target->done_seq >= w->seq) return NULL;
    *seq = w->seq;
    return w->target;
}

static int drain_held_locked(emu_stream *s, uint64_t upto, double deadline_ms);

/* The engine runs up to this many tasks of a stream per pick, taking the lock once for all of
 * them: with a launch loop feeding it, one lock hand-off per task would cost more than a
 * small kernel. */
#define EMU_ENGINE_BATCH 64

/* Run a batch of s's tasks from its head on the engine thread: the tasks are taken off the
 * queue under the lock, run without it, and finished under it again. A task that waits for
 * another stream is always a batch of its own (and ends the one before it): the tasks of a
 * batch finish together, and a wait inside a batch would delay the completion of the tasks
 * before it, which another stream's wait may need (a deadlock). */
static void run_batch_locked(emu_stream *s) {
    emu_task *first = s->head, *last = first;
    int n = 1;
    if (first->run != wait_run)
        while (n < EMU_ENGINE_BATCH && last->next && last->next->run != wait_run) {
            last = last->next;
            n++;
        }
    s->head = last->next;
    if (!s->head) s->tail = NULL;
    last->next = NULL;
    s->running = 1;
    pthread_mutex_unlock(&g_lock);
    int status[EMU_ENGINE_BATCH];
    char *fault_msg[EMU_ENGINE_BATCH]; /* each faulting task's message (rare: on the heap) */
    char msg[EMU_MSG_LEN];
    int i = 0;
    g_task_device = s->device;
    for (emu_task *t = first; t; t = t->next, i++) {
        msg[0] = 0;
        status[i] = t->run ? t->run(t->payload, msg, sizeof msg) : 0;
        fault_msg[i] = status[i] ? strdup(msg) : NULL;
    }
    g_task_device = -1;
    pthread_mutex_lock(&g_lock);
    s->running = 0;
    s->done_seq = last->seq;
    count_add(EMU_C_PENDING_TASKS, -n);
    i = 0;
    for (emu_task *t = first, *next; t; t = next, i++) {
        next = t->next;
        if (status[i]) {
            latch_fault_locked(s, status[i], fault_msg[i] ? fault_msg[i] : "device fault");
            free(fault_msg[i]);
        }
        if (t->release) t->release(t->payload);
        free(t);
    }
    if (g_waiters) pthread_cond_broadcast(&g_cond);
}

static void *engine_main(void *arg) {
    const unsigned gen = (unsigned)(uintptr_t)arg;
    int naps = 0;
    pthread_mutex_lock(&g_lock);
    while (g_engine_gen == gen) {
        emu_stream *s = g_async ? ready_pop_locked() : NULL;
        if (!s) {
            if (g_async && naps < EMU_ENGINE_NAPS) {
                struct timespec ts;
                clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of g_engine_cond */
                ts.tv_nsec += EMU_ENGINE_NAP_US * 1000L;
                if (ts.tv_nsec >= 1000000000L) {
                    ts.tv_sec++;
                    ts.tv_nsec -= 1000000000L;
                }
                g_engine_sleeping = 1;
                pthread_cond_timedwait(&g_engine_cond, &g_lock, &ts);
                naps++;
            } else {
                g_engine_sleeping = 2;
                pthread_cond_wait(&g_engine_cond, &g_lock);
                naps = 0;
            }
            g_engine_sleeping = 0;
            continue;
        }
        naps = 0;
        /* A helper may have taken the stream since it was listed; it hands it back when done. */
        if (s->head && !s->running) {
            uint64_t seq = 0;
            emu_stream *dep = blocked_on_locked(s, &seq);
            g_engine_busy = 1;
            if (dep) { /* run what the wait needs first (iteratively; see drain_held_locked) */
                dep->refs++;
                drain_held_locked(dep, seq, 0);
                stream_unref_locked(dep);
            } else {
                run_batch_locked(s);
            }
            g_engine_busy = 0;
            settle_locked(s); /* round robin: back to the tail if it has more */
        }
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return NULL;
}

static void engine_stop_locked(void) {
    ready_clear_locked();
    if (!g_engine_started) return;
    pthread_t t = g_engine_thread;
    g_engine_started = 0;
    g_engine_gen++;
    pthread_cond_broadcast(&g_engine_cond);
    pthread_mutex_unlock(&g_lock);
    pthread_join(t, NULL);
    pthread_mutex_lock(&g_lock);
}

void engine_forget_after_fork(void) {
    /* The engine thread does not exist in the child; the streams on the list are abandoned. */
    g_engine_started = 0;
    g_engine_gen++;
    g_engine_sleeping = 0;
    g_engine_busy = 0;
    g_ready_head = g_ready_tail = NULL;
}

/* A query that answers "not ready" to a thread polling in a loop gives the lock a moment
 * before it polls again: glibc's mutex is not fair, and a thread polling in a tight loop
 * re-takes it before the engine, woken from its wait for it, can, which delayed the work being
 * polled for by milliseconds. A loop is a second "not ready" with no enqueue by the thread in
 * between. A single query between launches (a binding checking a fence now and then) does not
 * yield: on a device such a query is one cheap driver call, and a yield on a busy machine costs
 * a whole time slice. */
static __thread uint64_t t_enqueues;  /* tasks this thread has queued */
static __thread uint64_t t_busy_mark; /* t_enqueues + 1 at this thread's last "not ready" */

static void poll_backoff(void) {
    if (t_busy_mark == t_enqueues + 1) sched_yield();
    t_busy_mark = t_enqueues + 1;
}

/* ------------------------------------------------------------------ stream execution */

/* Wait on g_cond until woken or until deadline_ms (CLOCK_MONOTONIC ms, 0: none). Returns 1
 * if the deadline has passed. */
static int wait_locked(double deadline_ms) {
    g_waiters++;
    int passed = 0;
    if (deadline_ms > 0) {
        double left = deadline_ms - now_ms();
        if (left <= 0) {
            passed = 1;
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of g_cond */
            long long ns = (long long)ts.tv_nsec + (long long)(left * 1e6);
            ts.tv_sec += (time_t)(ns / 1000000000LL);
            ts.tv_nsec = (long)(ns % 1000000000LL);
            pthread_cond_timedwait(&g_cond, &g_lock, &ts);
            passed = now_ms() >= deadline_ms;
        }
    } else {
        pthread_cond_wait(&g_cond, &g_lock);
    }
    g_waiters--;
    return passed;
}

/* drain_locked for a caller that holds a reference on s. A stream blocked by a wait needs the
 * waited-for stream to progress first, which may itself be blocked: the chain is followed with
 * an explicit path (frame i+1 is what frame i waits for), each frame holding a reference. */
typedef struct drain_frame {
    emu_stream *s;
    uint64_t upto;
} drain_frame;

static int drain_held_locked(emu_stream *s, uint64_t upto, double deadline_ms) {
    drain_frame local[8];
    drain_frame *path = local;
    size_t depth = 1, cap = sizeof local / sizeof local[0];
    path[0] = (drain_frame){s, upto};
    int timed_out = 0;
    int ran = 0;
    while (depth) {
        emu_stream *c = path[depth - 1].s;
        if (c->done_seq >= path[depth - 1].upto || (!c->head && !c->running)) {
            if (--depth) { /* a dependency is satisfied: back to the stream that needed it */
                settle_locked(c);
                stream_unref_locked(c);
            }
            continue;
        }
        if (c->running) { /* another thread runs it: wait for that task */
            if (wait_locked(deadline_ms)) {
                timed_out = s->done_seq < upto;
                break;
            }
            continue;
        }
        uint64_t seq = 0;
        emu_stream *dep = blocked_on_locked(c, &seq);
        if (dep) {
            if (depth == cap) {
                drain_frame *bigger = malloc(2 * cap * sizeof *bigger);
                if (!bigger) { /* cannot follow the chain: let other threads (the engine) do it */
                    if (wait_locked(deadline_ms)) {
                        timed_out = s->done_seq < upto;
                        break;
                    }
                    continue;
                }
                memcpy(bigger, path, depth * sizeof *path);
                if (path != local) free(path);
                path = bigger;
                cap *= 2;
            }
            dep->refs++;
            path[depth++] = (drain_frame){dep, seq};
            continue;
        }
        /* A poll with a deadline runs at least one task first, so it always makes progress. */
        if (deadline_ms > 0 && ran && now_ms() >= deadline_ms) {
            timed_out = 1;
            break;
        }
        run_head_locked(c);
        ran = 1;
    }
    while (depth > 1) { /* stopped early (deadline): give back the frames still held */
        emu_stream *c = path[--depth].s;
        settle_locked(c);
        stream_unref_locked(c);
    }
    if (path != local) free(path);
    settle_locked(s); /* work left behind goes (back) to the engine */
    return timed_out;
}

int drain_locked(emu_stream *s, uint64_t upto, double deadline_ms) {
    s->refs++;
    int timed_out = drain_held_locked(s, upto, deadline_ms);
    stream_unref_locked(s);
    return timed_out;
}

static void drain_all_locked(emu_stream *s) { drain_locked(s, s->next_seq, 0); }

/* Run every queued task of device d. The lock is released while tasks run, so streams may
 * come and go: rescan until a full pass finds nothing left. */
void drain_device_locked(int32_t d) {
    emu_stream *def = g_devices[d].default_stream;
    if (def) {
        def->refs++;
        drain_all_locked(def);
    }
    for (int again = 1; again;) {
        again = 0;
        for (uint32_t i = 0; i < g_streams.n && !again; i++) {
            emu_stream *s = emu_ht_at(&g_streams, i);
            if (s && s->device == d && s->done_seq < s->next_seq) {
                drain_all_locked(s);
                again = 1;
            }
        }
        if (!again && def && def->done_seq < def->next_seq) {
            drain_all_locked(def);
            again = 1;
        }
    }
    if (def) stream_unref_locked(def);
}

int take_pending_locked(emu_stream *s, char *msg, size_t len) {
    int st = s->pending_status;
    if (s->pending_faults == 1)
        snprintf(msg, len, "%s", s->pending_msg);
    else if (s->pending_faults > 1)
        snprintf(msg, len, "%lld tasks faulted since the stream's fault was last reported; the latest "
                 "overwrote the others: %s", (long long)s->pending_faults, s->pending_msg);
    s->pending_status = 0;
    s->pending_faults = 0;
    s->pending_msg[0] = 0;
    return st;
}

void engine_finalize_locked(void) {
    for (int d = 0; d < g_device_count; d++)
        if (g_devices[d].refcount > 0 && !g_devices[d].closing) drain_device_locked(d);
    engine_stop_locked();
    /* Work queued by other threads meanwhile goes to a new engine, not to nobody. */
    for (int d = 0; d < g_device_count; d++)
        if (g_devices[d].default_stream) settle_locked(g_devices[d].default_stream);
    for (uint32_t i = 0; i < g_streams.n; i++) {
        emu_stream *s = emu_ht_at(&g_streams, i);
        if (s) settle_locked(s);
    }
}

int enqueue_locked(emu_stream *s, emu_task_run run, emu_task_release release, void *payload) {
    if (g_async && s->next_seq - s->done_seq >= (uint64_t)g_queue_depth) {
        /* Full: wait (helping) until the oldest task beyond the bound has finished. The lock
         * is released meanwhile, so the stream may be destroyed (keep it alive to look), and
         * other threads may fill the room first (look again). */
        s->refs++;
        while (g_async && !s->dead && s->next_seq - s->done_seq >= (uint64_t)g_queue_depth)
            drain_held_locked(s, s->next_seq - (uint64_t)g_queue_depth + 1, 0);
        if (s->dead) {
            stream_unref_locked(s);
            return -2;
        }
        s->refs--; /* not the last reference: a live stream is held by its handle or device */
    }
    emu_task *t = malloc(sizeof *t);
    if (!t) return -1;
    t_enqueues++;
    t->next = NULL;
    t->seq = ++s->next_seq;
    t->run = run;
    t->release = release;
    t->payload = payload;
    if (s->tail) s->tail->next = t;
    else s->head = t;
    s->tail = t;
    count_add(EMU_C_PENDING_TASKS, 1);
    settle_locked(s);
    return 0;
}

int enqueue_status(const char *api, int r) {
    if (r == -2) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE,
                        "the stream was destroyed while this call waited for room in its queue");
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    if (r) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INTERNAL_ERROR, "out of host memory");
        return ACL_ERROR_RT_INTERNAL_ERROR;
    }
    return 0;
}

/* ------------------------------------------------------------------ stream objects */

emu_stream *stream_new_locked(int32_t device, int is_default) {
    static uint64_t created;
    emu_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->created = ++created;
    if (!is_default && emu_ht_add(&g_streams, s, &s->handle)) {
        free(s);
        return NULL;
    }
    s->device = device;
    s->is_default = is_default;
    s->refs = 1;
    return s;
}

void stream_unref_locked(emu_stream *s) {
    if (--s->refs == 0) free(s);
}

static void event_unref_locked(emu_event *e) {
    if (--e->refs == 0) {
        if (e->stream) stream_unref_locked(e->stream);
        free(e);
    }
}

/* Resolve a stream handle for use on `device`; NULL is the device's default stream. */
int resolve_stream_locked(const char *api, aclrtStream h, int32_t device, emu_stream **out) {
    if (!h) {
        if (!device_active_locked(device)) {
            aclemuSetErrMsg(api, ACL_ERROR_RT_CONTEXT_NULL, "device %d is not set", (int)device);
            return ACL_ERROR_RT_CONTEXT_NULL;
        }
        *out = g_devices[device].default_stream;
        return 0;
    }
    emu_stream *s = emu_ht_get(&g_streams, h);
    if (!s) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE,
                        "stream %p is not a live stream (destroyed, or never created)", h);
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    if (s->device != device) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_STREAM_CONTEXT,
                        "stream %p belongs to device %d but the current device is %d", h,
                        (int)s->device, (int)device);
        return ACL_ERROR_RT_STREAM_CONTEXT;
    }
    *out = s;
    return 0;
}

int stream_arg_locked(const char *api, aclrtStream h, int same_device, int32_t *device, emu_stream **out) {
    emu_stream *s = NULL;
    if (h && !(s = emu_ht_get(&g_streams, h))) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE,
                        "stream %p is not a live stream (destroyed, or never created)", h);
        return ACL_ERROR_RT_INVALID_HANDLE;
    }
    int st = require_device_locked(api, device);
    if (st) return st;
    if (!s) s = g_devices[*device].default_stream;
    if (same_device && s->device != *device) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_STREAM_CONTEXT,
                        "stream %p belongs to device %d but the current device is %d", h,
                        (int)s->device, (int)*device);
        return ACL_ERROR_RT_STREAM_CONTEXT;
    }
    *out = s;
    return 0;
}

/* The live event behind a handle: NULL is 100000 (the ACL layer refuses it), a handle that is
 * not a live event 107017 (RT_VALIDATE_AND_UNWRAP_OBJECT, v9.1.0; the emulator's choice on
 * every profile, where older releases read freed memory). */
static int event_locked(const char *api, aclrtEvent h, emu_event **out) {
    if (!h) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "event is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    *out = emu_ht_get(&g_events, h);
    if (*out) return 0;
    aclemuSetErrMsg(api, ACL_ERROR_RT_INVALID_HANDLE, "event %p is not a live event", h);
    return ACL_ERROR_RT_INVALID_HANDLE;
}

void event_release_all_of_device_locked(int32_t d) {
    for (uint32_t i = 0; i < g_events.n; i++) {
        emu_event *e = emu_ht_at(&g_events, i);
        if (e && e->device == d) {
            emu_ht_remove(&g_events, (const void *)e->handle);
            e->dead = 1;
            count_add(EMU_C_EVENTS, -1);
            event_unref_locked(e);
        }
    }
}

void stream_release_all_of_device_locked(int32_t d) {
    for (uint32_t i = 0; i < g_streams.n; i++) {
        emu_stream *s = emu_ht_at(&g_streams, i);
        if (s && s->device == d) {
            emu_ht_remove(&g_streams, (const void *)s->handle);
            s->dead = 1;
            count_add(EMU_C_STREAMS, -1);
            stream_unref_locked(s);
        }
    }
}

/* ------------------------------------------------------------------ stream mode */

EMU_API int aclemuSetStreamMode(const char *mode) {
    int async;
    if (mode && strcmp(mode, "async") == 0) async = 1;
    else if (mode && strcmp(mode, "lazy") == 0) async = 0;
    else return -1;
    pthread_mutex_lock(&g_lock);
    config_locked();
    if (async && !g_async) {
        g_async = 1;
        for (int d = 0; d < g_device_count; d++)
            if (g_devices[d].default_stream) settle_locked(g_devices[d].default_stream);
        for (uint32_t i = 0; i < g_streams.n; i++) {
            emu_stream *s = emu_ht_at(&g_streams, i);
            if (s) settle_locked(s);
        }
    } else if (!async && g_async) {
        g_async = 0;
        ready_clear_locked();
        /* Once this returns nothing runs in the background: let a task in flight finish. */
        while (g_engine_busy) wait_locked(0);
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

EMU_API const char *aclemuGetStreamMode(void) {
    pthread_mutex_lock(&g_lock);
    config_locked();
    int async = g_async;
    pthread_mutex_unlock(&g_lock);
    return async ? "async" : "lazy";
}

/* ------------------------------------------------------------------ the second phase */

EMU_API int aclemuLaunch(const char *api, int32_t device, aclrtStream stream, uintptr_t workspace,
                         uint64_t workspace_size, int *mutation_slot, emu_task_run run,
                         emu_task_release release, void *payload) {
    pthread_mutex_lock(&g_lock);
    config_locked();
    int st = 0;
    emu_stream *s = NULL;
    int32_t cur = current_device_locked();
    if (cur < 0) {
        st = ACLNN_ERR_RUNTIME_ERROR;
        aclemuSetErrMsg(api, st, "no device context: call aclrtSetDevice on this thread first");
    } else if (cur != device) {
        st = ACLNN_ERR_RUNTIME_ERROR;
        aclemuSetErrMsg(api, st, "the executor was built on device %d but the current device is %d",
                        (int)device, (int)cur);
    } else {
        int rt = resolve_stream_locked(api, stream, device, &s);
        if (rt) {
            st = ACLNN_ERR_RUNTIME_ERROR;
            aclemuSetErrMsg(api, st,
                            "stream %p cannot run the kernel (runtime status %d): it is not a live "
                            "stream of device %d",
                            stream, rt, (int)device);
        }
    }
    if (!st && workspace_size) {
        emu_block *b = find_block_locked(workspace, NULL);
        /* The block holds `workspace`, so the room left in it is computed without the sum
         * workspace + workspace_size, which a huge size would wrap. */
        if (!b || b->device != device || workspace_size > b->addr + b->padded - workspace) {
            st = ACLNN_ERR_PARAM_INVALID;
            aclemuSetErrMsg(api, st,
                            "workspace [%p, +%llu) is not inside a live device allocation of device %d",
                            (void *)workspace, (unsigned long long)workspace_size, (int)device);
        }
    }
    if (!st && run) {
        if (mutation_slot) *mutation_slot = g_mutation;
        int r = enqueue_locked(s, run, release, payload);
        if (r == -2) {
            st = ACLNN_ERR_RUNTIME_ERROR;
            aclemuSetErrMsg(api, st, "stream %p was destroyed while the launch waited for room", stream);
        } else if (r) {
            st = ACLNN_ERR_INNER;
            aclemuSetErrMsg(api, st, "out of host memory while queueing the kernel");
        }
    }
    if (st && release) release(payload);
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ streams
 *
 * Each entry follows hicann/runtime v9.1.0: the ACL layer's checks (src/acl/aclrt_impl/
 * stream.cpp, event.cpp) first, then the runtime's handle validation (api_c_stream.cc, api_c.cc),
 * then ApiErrorDecorator (api_error.cc), then ApiImpl's current context (api_impl.cc). */

EMU_API aclError aclrtCreateStream(aclrtStream *stream) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!stream) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "stream is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0; /* set by require_device_locked; 0 keeps the error paths defined */
    int st = require_device_locked(api, &d);
    if (!st) {
        emu_stream *s = stream_new_locked(d, 0);
        if (!s) {
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            count_add(EMU_C_STREAMS, 1);
            *stream = (aclrtStream)s->handle;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* NULL 100000 (the default stream is not destroyed this way); not a live stream 107017; no
 * current device 107002; another device's stream 107003 (ApiImpl::StreamDestroy). Queued work
 * runs first (Stream::TearDown waits for pending tasks); a fault it latched is dropped with the
 * stream. */
EMU_API aclError aclrtDestroyStream(aclrtStream stream) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!stream) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "stream is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    emu_stream *s = NULL;
    int st = config_error_locked(api);
    if (!st) st = stream_arg_locked(api, stream, 1, &d, &s);
    if (!st) {
        /* The handle is gone, so nothing new can be queued; a caller waiting for room gives
         * up. Tasks still queued run to completion first, as the hardware would finish them. */
        emu_ht_remove(&g_streams, stream);
        s->dead = 1;
        count_add(EMU_C_STREAMS, -1);
        drain_all_locked(s);
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* After the checks: wait for every task queued so far (timeout -1: no limit). A wait that ends
 * by its deadline is 507046 and leaves the latched fault for a later synchronize
 * (Stream::GetSynchronizeError returns the wait's own error first); a wait that completes
 * reports the latched fault and clears it (Stream::GetError). A stream of another device is
 * synchronized as it is (ApiImpl::StreamSynchronize switches to its context). */
static int sync_stream(const char *api, aclrtStream stream, int32_t timeout) {
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    emu_stream *s = NULL;
    int st = config_error_locked(api);
    if (!st && stream && !emu_ht_get(&g_streams, stream)) {
        st = ACL_ERROR_RT_INVALID_HANDLE;
        aclemuSetErrMsg(api, st, "stream %p is not a live stream (destroyed, or never created)", stream);
    }
    if (!st && timeout == 0) { /* ApiErrorDecorator::StreamSynchronize: -1 or above 0 */
        st = ACL_ERROR_RT_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "timeout 0 is invalid: use -1 (no limit) or a positive number of ms");
    }
    if (!st) st = stream_arg_locked(api, stream, 0, &d, &s);
    if (!st) {
        s->refs++;
        double deadline = timeout > 0 ? now_ms() + (double)timeout : 0;
        int timed_out = drain_locked(s, s->next_seq, deadline);
        if (timed_out) {
            st = ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
            aclemuSetErrMsg(api, st, "%lld task(s) still queued after %d ms",
                            (long long)(s->next_seq - s->done_seq), (int)timeout);
        } else {
            char msg[EMU_MSG_LEN];
            st = take_pending_locked(s, msg, sizeof msg);
            if (st) aclemuSetErrMsg(api, st, "%s", msg);
        }
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

EMU_API aclError aclrtSynchronizeStream(aclrtStream stream) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    return sync_stream(api, stream, -1);
}

/* timeout below -1: 107000 from the ACL layer (stream.cpp), before the handle is looked at; 0:
 * 107000 from the runtime, after it (the header's "0: check once" is not what the source does). */
EMU_API aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (timeout < -1) {
        aclemuSetErrMsg(api, ACL_ERROR_RT_PARAM_INVALID, "timeout %d is below -1", (int)timeout);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return sync_stream(api, stream, timeout);
}

/* status NULL 100000; not a live stream 107017; no current device 107002; NULL: the default
 * stream; another device's stream is queried as it is (ApiImpl::StreamQuery compares no
 * context). Runs nothing, and neither reports nor clears a latched fault (Stream::Query reads
 * no error code). */
EMU_API aclError aclrtStreamQuery(aclrtStream stream, aclrtStreamStatus *status) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!status) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "status is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    emu_stream *s = NULL;
    int st = config_error_locked(api);
    if (!st) st = stream_arg_locked(api, stream, 0, &d, &s);
    int busy = 0;
    if (!st) {
        busy = s->done_seq != s->next_seq;
        *status = busy ? ACL_STREAM_STATUS_NOT_READY : ACL_STREAM_STATUS_COMPLETE;
    }
    pthread_mutex_unlock(&g_lock);
    if (busy) poll_backoff();
    return st;
}

static void wait_release(void *p) { /* lock held */
    wait_payload *w = p;
    stream_unref_locked(w->target);
    free(w);
}

/* event NULL 100000; stream, then event, not live 107017; no current device 107002; NULL: the
 * default stream; another device's stream 107003; an event never recorded 107000 (Event::Wait:
 * aclrtCreateEvent makes old-mode events, and "The event has not been recorded"). Otherwise the
 * stream waits for the event's latest record at the time of the call: nothing to wait for when
 * that record already ran or is on this same stream. */
EMU_API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!event) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "event is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    emu_stream *s = NULL;
    emu_event *e = NULL;
    int st = config_error_locked(api);
    if (!st && stream && !emu_ht_get(&g_streams, stream)) {
        st = ACL_ERROR_RT_INVALID_HANDLE;
        aclemuSetErrMsg(api, st, "stream %p is not a live stream (destroyed, or never created)", stream);
    }
    if (!st) st = event_locked(api, event, &e);
    if (!st) st = stream_arg_locked(api, stream, 1, &d, &s);
    if (!st && e->records == 0) {
        st = ACL_ERROR_RT_PARAM_INVALID;
        aclemuSetErrMsg(api, st, "event %p was never recorded: record it on a stream first", event);
    }
    if (!st && e->stream != s && e->stream->done_seq < e->seq) {
        wait_payload *w = malloc(sizeof *w);
        if (w) {
            w->target = e->stream;
            w->seq = e->seq;
            e->stream->refs++;
        }
        st = enqueue_status(api, w ? enqueue_locked(s, wait_run, wait_release, w) : -1);
        if (st && w) wait_release(w);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* ------------------------------------------------------------------ events */

EMU_API aclError aclrtCreateEvent(aclrtEvent *event) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!event) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "event is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    int32_t d = 0; /* set by require_device_locked; 0 keeps the error paths defined */
    int st = require_device_locked(api, &d);
    if (!st) {
        emu_event *e = calloc(1, sizeof *e);
        if (!e || emu_ht_add(&g_events, e, &e->handle)) {
            free(e);
            st = ACL_ERROR_RT_INTERNAL_ERROR;
            aclemuSetErrMsg(api, st, "out of host memory");
        } else {
            e->device = d;
            e->refs = 1;
            count_add(EMU_C_EVENTS, 1);
            *event = (aclrtEvent)e->handle;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* NULL 100000; not a live event 107017; needs no current device, and waits for nothing (a
 * record still queued completes without it). */
EMU_API aclError aclrtDestroyEvent(aclrtEvent event) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    emu_event *e = NULL;
    int st = config_error_locked(api);
    if (!st) st = event_locked(api, event, &e);
    if (!st) {
        emu_ht_remove(&g_events, event);
        e->dead = 1;
        count_add(EMU_C_EVENTS, -1);
        event_unref_locked(e);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

typedef struct record_payload {
    emu_event *event;
    uint64_t id;
} record_payload;

static int record_run(void *p, char *msg, size_t len) {
    (void)msg;
    (void)len;
    record_payload *r = p;
    double t = now_ms(); /* the time the engine (or a helper) reaches the record */
    pthread_mutex_lock(&g_lock);
    if (r->id > r->event->completed) {
        r->event->completed = r->id;
        r->event->ts_ms = t;
    }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

static void record_release(void *p) { /* lock held */
    record_payload *r = p;
    event_unref_locked(r->event);
    free(r);
}

/* event NULL 100000; event, then stream, not live 107017; no current device 107002; NULL: the
 * default stream; another device's stream 107003 (ApiImpl::EventRecord). Recording again moves
 * the event to the new record. */
EMU_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    int32_t d = 0;
    emu_stream *s = NULL;
    emu_event *e = NULL;
    int st = config_error_locked(api);
    if (!st) st = event_locked(api, event, &e);
    if (!st) st = stream_arg_locked(api, stream, 1, &d, &s);
    if (!st) {
        record_payload *r = malloc(sizeof *r);
        if (r) {
            r->event = e;
            e->refs++;
        }
        /* The record's id and position are fixed only once it is queued: an enqueue on a full
         * stream releases the lock while it waits, and another record may come first. */
        int q = r ? enqueue_locked(s, record_run, record_release, r) : -1;
        st = enqueue_status(api, q);
        if (st) {
            if (r) record_release(r);
        } else {
            r->id = ++e->records;
            if (e->stream) stream_unref_locked(e->stream);
            e->stream = s;
            s->refs++;
            e->seq = s->next_seq;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* NULL 100000; not a live event 107017; needs no current device (the event's own context). An
 * event never recorded: 0 at once (Event::Synchronize). Otherwise it waits for the latest record
 * and returns 0: a fault latched on the record's stream is neither reported nor cleared here
 * (continue-on-failure mode reads no stream error in the event's wait); the stream's next
 * synchronize, or aclrtSynchronizeDevice, reports it. */
EMU_API aclError aclrtSynchronizeEvent(aclrtEvent event) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    pthread_mutex_lock(&g_lock);
    emu_event *e = NULL;
    int st = config_error_locked(api);
    if (!st) st = event_locked(api, event, &e);
    if (!st && e->stream) {
        emu_stream *s = e->stream;
        s->refs++;
        drain_locked(s, e->seq, 0);
        stream_unref_locked(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* event, then status, NULL 100000; not a live event 107017; no current device needed. COMPLETE
 * once the latest record has run; NOT_READY while it is queued, and for an event never recorded
 * (Event::QueryEventStatus: an old-mode event, as aclrtCreateEvent makes, is RT_EVENT_INIT until
 * its first record). Runs nothing, reports no fault. */
EMU_API aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (event && !status) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "status is NULL");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    emu_event *e = NULL;
    int st = config_error_locked(api);
    if (!st) st = event_locked(api, event, &e);
    int busy = 0;
    if (!st) {
        busy = e->records == 0 || e->completed != e->records;
        *status = busy ? ACL_EVENT_RECORDED_STATUS_NOT_READY : ACL_EVENT_RECORDED_STATUS_COMPLETE;
    }
    pthread_mutex_unlock(&g_lock);
    if (busy) poll_backoff();
    return st;
}

/* ms, start, end NULL 100000; start, then end, not a live event 107017; either never recorded
 * 507000 (RT_ERROR_EVENT_RECORDER_NULL); either record not yet run 107006 (its timestamp is not
 * there yet: RT_ERROR_EVENT_TIMESTAMP_INVALID); otherwise end minus start in ms, which is
 * negative when the end's record ran first (Event::ElapsedTime has no order check). */
EMU_API aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent) {
    EMU_ENTRY(ACL_ERROR_RT_INTERNAL_ERROR);
    if (!ms || !startEvent || !endEvent) {
        aclemuSetErrMsg(api, ACL_ERROR_INVALID_PARAM, "%s is NULL",
                        !ms ? "ms" : !startEvent ? "startEvent" : "endEvent");
        return ACL_ERROR_INVALID_PARAM;
    }
    pthread_mutex_lock(&g_lock);
    emu_event *a = NULL, *b = NULL;
    int st = config_error_locked(api);
    if (!st) st = event_locked(api, startEvent, &a);
    if (!st) st = event_locked(api, endEvent, &b);
    if (!st && (a->records == 0 || b->records == 0)) {
        st = ACL_ERROR_RT_INTERNAL_ERROR;
        aclemuSetErrMsg(api, st, "the %s event was never recorded", a->records ? "end" : "start");
    }
    if (!st && (a->completed != a->records || b->completed != b->records)) {
        st = ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID;
        aclemuSetErrMsg(api, st,
                        "the %s event's record has not run yet (no timestamp): synchronize its "
                        "stream or the event first",
                        a->completed != a->records ? "start" : "end");
    }
    if (!st) *ms = (float)(b->ts_ms - a->ts_ms);
    pthread_mutex_unlock(&g_lock);
    return st;
}
