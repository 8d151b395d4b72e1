/*
 * profile.c — optional per-function timing: exclusive (self) wall time and
 * call counts of each function's forward and backward, for benchmarks.
 *
 * Off by default; when off, the hooks cost one thread-local load. Nested
 * calls (ops inside a checkpoint region's forward or backward) are charged
 * to the innermost function only, so the entries add up to the time spent
 * inside functions. State is thread-local, like the tape.
 * Must never: allocate, or change what a function computes.
 */
#include "internal.h"

#include <string.h>
#include <time.h>

#define MAX_ENTRIES 64
#define MAX_DEPTH 32

typedef struct frame {
    double start, children;
} frame;

static _Thread_local int enabled;
static _Thread_local loom_profile_entry entries[MAX_ENTRIES];
static _Thread_local int n_entries;
static _Thread_local frame stack[MAX_DEPTH];
static _Thread_local int depth;

double autograd_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void loom_profile_enable(int on) {
    enabled = on != 0;
    depth = 0;
}

void loom_profile_reset(void) {
    n_entries = 0;
    depth = 0;
}

int loom_profile_get(loom_profile_entry *out, int max) {
    int n = n_entries < max ? n_entries : max;
    memcpy(out, entries, (size_t)n * sizeof *out);
    return n_entries;
}

void profile_enter(void) {
    if (!enabled) return;
    if (depth < MAX_DEPTH) stack[depth] = (frame){autograd_seconds(), 0.0};
    depth++;
}

void profile_leave(const loom_function *fn, int backward) {
    if (!enabled || depth == 0) return;
    depth--;
    if (depth >= MAX_DEPTH) return;
    double total = autograd_seconds() - stack[depth].start;
    if (depth > 0 && depth - 1 < MAX_DEPTH) stack[depth - 1].children += total;
    int i = 0;
    while (i < n_entries && !(entries[i].name == fn->name && entries[i].backward == backward)) i++;
    if (i == n_entries) {
        if (n_entries == MAX_ENTRIES) return;
        entries[n_entries++] = (loom_profile_entry){fn->name, backward, 0.0, 0};
    }
    entries[i].seconds += total - stack[depth].children;
    entries[i].calls++;
}
