/* cli.c — flag parsing and help for the loom subcommands; see cli.h. */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int parse_value(const char *cmd, const flag *f, const char *v) {
    char *end;
    switch (f->kind) {
    case FLAG_STRING:
        if (!*v) return cli_usage_error(cmd, "--%s expects a value (%s), got an empty string", f->name, f->metavar), -1;
        *(const char **)f->target = v;
        return 0;
    case FLAG_TEXT:
        *(const char **)f->target = v;
        return 0;
    case FLAG_INT: {
        errno = 0;
        long x = strtol(v, &end, 10);
        if (*v == '\0' || *end)
            return cli_usage_error(cmd, "--%s expects an integer, got '%s'", f->name, v), -1;
        if (errno == ERANGE || x < -2147483647L || x > 2147483647L)
            return cli_usage_error(cmd, "--%s %s is out of range (at most 2147483647 in size)", f->name, v), -1;
        *(int *)f->target = (int)x;
        return 0;
    }
    case FLAG_FLOAT:
    case FLAG_DOUBLE: {
        errno = 0;
        double x = strtod(v, &end);
        if (*v == '\0' || *end || errno == ERANGE || !isfinite(x) || (f->kind == FLAG_FLOAT && fabs(x) > FLT_MAX))
            return cli_usage_error(cmd, "--%s expects a finite number, got '%s'", f->name, v), -1;
        if (f->kind == FLAG_FLOAT) *(float *)f->target = (float)x;
        else *(double *)f->target = x;
        return 0;
    }
    case FLAG_LIST: {
        if (!*v) return cli_usage_error(cmd, "--%s expects %s, got an empty string", f->name, f->metavar), -1;
        string_list *l = f->target;
        const char **items = realloc(l->items, (size_t)(l->n + 1) * sizeof *items);
        if (!items) return cli_usage_error(cmd, "out of memory"), -1;
        l->items = items;
        l->items[l->n++] = v;
        return 0;
    }
    case FLAG_BOOL:
        break;
    }
    return -1;
}

int cli_parse(const command *cmd, const flag *flags, int n_flags, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cli_print_help(stdout, cmd, flags, n_flags);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0)
            return cli_usage_error(cmd->name, "unexpected argument '%s' (flags start with --; see loom %s --help)", a,
                                   cmd->name), -1;
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const flag *f = NULL;
        for (int k = 0; k < n_flags; k++)
            if (strlen(flags[k].name) == len && !strncmp(flags[k].name, name, len)) f = &flags[k];
        if (!f)
            return cli_usage_error(cmd->name, "unknown flag '%.*s' (see loom %s --help)", (int)len + 2, a, cmd->name), -1;
        if (f->kind == FLAG_BOOL) {
            if (eq) return cli_usage_error(cmd->name, "--%s takes no value", f->name), -1;
            *(int *)f->target = 1;
            continue;
        }
        const char *v = eq ? eq + 1 : NULL;
        if (!v) {
            if (i + 1 >= argc) return cli_usage_error(cmd->name, "--%s needs a value (%s)", f->name, f->metavar), -1;
            v = argv[++i];
        }
        if (parse_value(cmd->name, f, v) != 0) return -1;
        /* A list takes every following argument that is not a flag (-x, --x) too. */
        while (f->kind == FLAG_LIST && i + 1 < argc && !(argv[i + 1][0] == '-' && argv[i + 1][1]))
            if (parse_value(cmd->name, f, argv[++i]) != 0) return -1;
    }
    return 0;
}

void cli_print_help(FILE *out, const command *cmd, const flag *flags, int n_flags) {
    fprintf(out, "usage: loom %s\n\n%s\n\nflags:\n", cmd->usage, cmd->summary);
    for (int k = 0; k < n_flags; k++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", flags[k].name, flags[k].metavar ? " " : "",
                 flags[k].metavar ? flags[k].metavar : "");
        fprintf(out, "  %-26s %s\n", left, flags[k].help);
    }
    fprintf(out, "  %-26s %s\n", "--help", "show this help");
    if (cmd->details) fprintf(out, "\n%s\n", cmd->details);
}

int cli_fail(const char *cmd, loom_status st) {
    fprintf(stderr, "loom %s: %s\n", cmd, *loom_last_error() ? loom_last_error() : loom_status_name(st));
    return 1;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "loom %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

int cli_apply_threads(const char *cmd, int n) {
    if (n < 0) return cli_usage_error(cmd, "--threads must be >= 0 (0: all cores), got %d", n);
    if (n > LOOM_MAX_THREADS)
        return cli_usage_error(cmd, "--threads %d is more than loom's limit of %d (0: all cores)", n, LOOM_MAX_THREADS);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores > 0 && n > cores)
        fprintf(stderr, "loom %s: note: --threads %d is more than the %ld cores here; threads beyond the cores "
                "share them and slow every step\n", cmd, n, cores);
    loom_set_threads(n); /* 0: the default, which also clamps an oversized OMP_NUM_THREADS */
    return 0;
}

int cli_check_model_dir(const char *cmd, const char *model) {
    char probe[4200];
    struct stat sb;
    snprintf(probe, sizeof probe, "%s/config.json", model);
    if (stat(probe, &sb) == 0) return 0;
    snprintf(probe, sizeof probe, "%s/model/config.json", model);
    if (stat(probe, &sb) == 0)
        return cli_usage_error(cmd, "%s has no config.json: it looks like a training run's output; the model is "
                               "--model %s/model (or a checkpoint, %s/ckpt-N)", model, model, model);
    return cli_usage_error(cmd, "%s is not a model directory (no config.json; loom train writes one in --out/model "
                           "and in each checkpoint, loom export in its --out)", model);
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int cli_parse_on_off(const char *cmd, const char *flag_name, const char *value, int *out) {
    if (!strcmp(value, "on") || !strcmp(value, "true") || !strcmp(value, "1")) *out = 1;
    else if (!strcmp(value, "off") || !strcmp(value, "false") || !strcmp(value, "0")) *out = 0;
    else return cli_usage_error(cmd, "--%s expects on or off, got '%s'", flag_name, value);
    return 0;
}

loom_status cli_lock_dir(const char *dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/.loom.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644); /* kept open: the lock lives until exit */
    if (fd < 0) return loom_error(LOOM_ERR_IO, "%s: cannot create %s", strerror(errno), path);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        char holder[32] = "";
        ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
        holder[n > 0 ? n : 0] = '\0';
        holder[strcspn(holder, "\n")] = '\0';
        close(fd);
        if (err == EWOULDBLOCK)
            return loom_error(LOOM_ERR_STATE, "%s is in use by another loom process (pid %s, %s): wait for it to "
                              "finish, or use another output directory", dir, *holder ? holder : "unknown", path);
        if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) { /* a file system without locks: go on */
            fprintf(stderr, "loom: note: %s cannot be locked (%s): nothing stops another loom process from writing "
                    "there at the same time\n", dir, strerror(err));
            return LOOM_OK;
        }
        return loom_error(LOOM_ERR_IO, "%s: cannot lock %s", strerror(err), path);
    }
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) { /* the holder's pid is only a hint */ }
    return LOOM_OK;
}
