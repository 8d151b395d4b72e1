/*
 * status.c — the thread-local last-error message and status names.
 * Owns: loom_error / loom_last_error. Must never allocate: messages live in a
 * fixed thread-local buffer so reporting an out-of-memory error cannot fail.
 */
#include "loom/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Room for a message that names three full paths and still ends with why. */
static _Thread_local char last_error[16384];

const char *loom_last_error(void) { return last_error; }

void loom_clear_error(void) { last_error[0] = '\0'; }

/* Formats into a local buffer first: an argument may be loom_last_error()
 * itself (adding context to a message), and vsnprintf's destination must not
 * overlap its arguments. */
loom_status loom_error(loom_status st, const char *fmt, ...) {
    char msg[sizeof last_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(last_error, msg, strlen(msg) + 1);
    return st;
}

const char *loom_status_name(loom_status st) {
    switch (st) {
    case LOOM_OK: return "ok";
    case LOOM_ERR_INVALID: return "invalid argument";
    case LOOM_ERR_NOMEM: return "out of memory";
    case LOOM_ERR_IO: return "I/O error";
    case LOOM_ERR_FORMAT: return "bad file format";
    case LOOM_ERR_STATE: return "invalid state";
    case LOOM_ERR_NUMERIC: return "non-finite value";
    case LOOM_ERR_UNSUPPORTED: return "unsupported";
    case LOOM_ERR_DIST: return "distributed error";
    }
    return "unknown status";
}

void loom_panic(const char *file, int line, const char *msg) {
    fprintf(stderr, "loom: internal error at %s:%d: %s\n", file, line, msg);
    abort();
}
