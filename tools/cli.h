/*
 * cli.h — what the loom subcommands share: a table-driven flag parser that
 * rejects unknown flags with a clear message, help text from the same table,
 * and a few helpers. The CLI never aborts: errors print "loom CMD: message"
 * and return a non-zero exit code.
 */
#ifndef LOOM_CLI_H
#define LOOM_CLI_H

#include "loom/loom.h"

#include <stdio.h>

/* FLAG_STRING refuses an empty value (a path or a name); FLAG_TEXT is free
 * text, where "" is a value like any other (a prompt). FLAG_DOUBLE keeps a
 * decimal exactly as strtod reads it, for values whose products are
 * compared (0.7f is 0.69999998: ten documents at --val-fraction 0.7 gave
 * six to validation). */
typedef enum flag_kind { FLAG_STRING, FLAG_TEXT, FLAG_INT, FLAG_FLOAT, FLAG_DOUBLE, FLAG_BOOL, FLAG_LIST } flag_kind;

typedef struct flag {
    const char *name;     /* without the leading "--" */
    flag_kind kind;
    void *target;         /* const char ** (string, text) / int * / float * / double * / int * (bool) / string_list * */
    const char *metavar;  /* e.g. "N", "DIR" (NULL for booleans) */
    const char *help;
} flag;

typedef struct string_list {
    const char **items;
    int n;
} string_list;

typedef struct command {
    const char *name;
    const char *summary;
    const char *usage;     /* the line after "usage: loom " */
    const char *details;   /* paragraph after the flag list, may be NULL */
    int (*run)(int argc, char **argv);
} command;

/* Parse argv[1..] against flags. Returns 0 on success, 1 when --help was
 * printed (the caller exits 0), -1 on error (message printed). */
int cli_parse(const command *cmd, const flag *flags, int n_flags, int argc, char **argv);
void cli_print_help(FILE *f, const command *cmd, const flag *flags, int n_flags);
/* Print "loom CMD: <loom_last_error()>" and return 1. */
int cli_fail(const char *cmd, loom_status st);
/* Print "loom CMD: <formatted>" and return 2 (usage error). */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
double cli_now(void);
int cli_parse_on_off(const char *cmd, const char *flag_name, const char *value, int *out);
/* --threads N: 0 keeps the default (all cores), N > 0 sets it; 0 returned,
 * or 2 after a usage error for N < 0. */
int cli_apply_threads(const char *cmd, int n);
/* A usage error (2) naming what model is when it has no config.json (and
 * pointing at model/ when it is a training run's output), else 0. */
int cli_check_model_dir(const char *cmd, const char *model);

/* Hold an exclusive lock on DIR/.loom.lock (flock, with this pid written in
 * it) until the process exits, so two loom processes never write one output
 * directory at once. LOOM_ERR_STATE, naming the holder, when another has it. */
loom_status cli_lock_dir(const char *dir);

extern const command cmd_train, cmd_eval, cmd_generate, cmd_tokenize, cmd_export, cmd_bench;

#endif
