/*
 * Handle tables for the emulator's opaque objects (streams, events, contexts, tensors, scalars,
 * int arrays, executors). Header-only: each library compiles its own copy.
 *
 * A handle is not the object's address. It encodes (kind, generation, slot):
 *
 *     bits 56..63  kind      one byte per object type, never 0, so NULL is never a handle and a
 *                            stream handle never resolves as an event
 *     bits 24..55  generation of the slot when the object was added
 *     bits  0..23  slot      index into the table
 *
 * Lookup is O(1): decode, bounds-check, compare the generation. Removing an object bumps its
 * slot's generation, so the old handle stays invalid even after the slot is reused by a newer
 * object: a stale handle can never reach a newer object (the address of a freed object, which
 * malloc reuses, could). A slot whose generation would wrap is retired instead of reused.
 * The values are not canonical addresses, so a caller that dereferences a handle faults at once.
 *
 * Not thread-safe by itself: every table is guarded by its library's lock.
 */
#ifndef PYACL_MOE_EMU_HANDLES_H
#define PYACL_MOE_EMU_HANDLES_H

#include <stdint.h>
#include <stdlib.h>

_Static_assert(sizeof(uintptr_t) == 8, "handles encode 64 bits");

#define EMU_HT_SLOT_BITS 24
#define EMU_HT_MAX_SLOTS ((uint32_t)1 << EMU_HT_SLOT_BITS)
#define EMU_HT_NO_SLOT UINT32_MAX

enum {
    EMU_KIND_STREAM = 0x51,
    EMU_KIND_EVENT = 0x52,
    EMU_KIND_CONTEXT = 0x53,
    EMU_KIND_TENSOR = 0x61,
    EMU_KIND_SCALAR = 0x62,
    EMU_KIND_INT_ARRAY = 0x63,
    EMU_KIND_EXECUTOR = 0x64,
    EMU_KIND_TENSOR_LIST = 0x65,
};

typedef struct emu_ht_entry {
    void *obj;          /* NULL when the slot is free */
    uint32_t gen;       /* generation of the current (or next) occupant */
    uint32_t next_free; /* free list link */
} emu_ht_entry;

typedef struct emu_htab {
    emu_ht_entry *e;
    uint32_t n;         /* slots in use or freed (high-water mark) */
    uint32_t cap;
    uint32_t free_head; /* EMU_HT_NO_SLOT when empty */
    uint32_t live;
    uint8_t kind;
} emu_htab;

#define EMU_HTAB_INIT(k) {NULL, 0, 0, EMU_HT_NO_SLOT, 0, (k)}

static inline uintptr_t emu_ht_encode(const emu_htab *t, uint32_t slot, uint32_t gen) {
    return ((uintptr_t)t->kind << 56) | ((uintptr_t)gen << EMU_HT_SLOT_BITS) | (uintptr_t)slot;
}

/* Register obj; its handle goes to *handle. 0, or -1 when out of memory or slots. */
static inline int emu_ht_add(emu_htab *t, void *obj, uintptr_t *handle) {
    uint32_t slot = t->free_head;
    if (slot != EMU_HT_NO_SLOT) {
        t->free_head = t->e[slot].next_free;
    } else {
        if (t->n == EMU_HT_MAX_SLOTS) return -1;
        if (t->n == t->cap) {
            uint32_t ncap = t->cap ? t->cap * 2 : 64;
            if (ncap > EMU_HT_MAX_SLOTS) ncap = EMU_HT_MAX_SLOTS;
            emu_ht_entry *ne = realloc(t->e, (size_t)ncap * sizeof *ne);
            if (!ne) return -1;
            t->e = ne;
            t->cap = ncap;
        }
        slot = t->n++;
        t->e[slot].gen = 1;
    }
    t->e[slot].obj = obj;
    t->e[slot].next_free = EMU_HT_NO_SLOT;
    t->live++;
    *handle = emu_ht_encode(t, slot, t->e[slot].gen);
    return 0;
}

/* The live object behind a handle, or NULL (stale, foreign, NULL or another kind). */
static inline void *emu_ht_get(const emu_htab *t, const void *handle) {
    uintptr_t h = (uintptr_t)handle;
    if ((uint8_t)(h >> 56) != t->kind) return NULL;
    uint32_t slot = (uint32_t)(h & (EMU_HT_MAX_SLOTS - 1));
    uint32_t gen = (uint32_t)(h >> EMU_HT_SLOT_BITS);
    if (slot >= t->n || t->e[slot].gen != gen) return NULL;
    return t->e[slot].obj;
}

/* Free a slot: its generation moves on, so every handle of the old occupant stays stale. */
static inline void emu_ht_release_slot(emu_htab *t, uint32_t slot) {
    t->e[slot].obj = NULL;
    t->live--;
    if (t->e[slot].gen == UINT32_MAX) return; /* retired: never reused */
    t->e[slot].gen++;
    t->e[slot].next_free = t->free_head;
    t->free_head = slot;
}

/* Unregister a handle; returns its object, or NULL if the handle was not live. */
static inline void *emu_ht_remove(emu_htab *t, const void *handle) {
    void *obj = emu_ht_get(t, handle);
    if (obj) emu_ht_release_slot(t, (uint32_t)((uintptr_t)handle & (EMU_HT_MAX_SLOTS - 1)));
    return obj;
}

/* Slot i's object (NULL if free), for scans: for (i = 0; i < t->n; i++). */
static inline void *emu_ht_at(const emu_htab *t, uint32_t i) { return t->e[i].obj; }

/* Forget every object without touching it (they are leaked on purpose: after fork, a thread
 * that no longer exists may have been using them). Every old handle stays stale. */
static inline void emu_ht_abandon(emu_htab *t) {
    for (uint32_t i = 0; i < t->n; i++)
        if (t->e[i].obj) emu_ht_release_slot(t, i);
}

#endif
