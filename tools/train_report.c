/* train_report.c — progress, metrics and the loss plot; see train_report.h. */
#include "train_report.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void train_report_init(train_report *r, int log_every) {
    memset(r, 0, sizeof *r);
    r->tty = isatty(STDERR_FILENO);
    r->log_every = log_every > 0 ? log_every : 1;
}

void train_report_free(train_report *r) {
    free(r->train_loss); free(r->train_step); free(r->val_loss); free(r->val_step);
}

static void push(double **v, int **s, int *n, int *cap, int step, double x) {
    if (*n == *cap) {
        int c = *cap ? 2 * *cap : 256;
        /* Each pointer is kept as soon as its realloc succeeds (the old
         * block may be gone); the capacity grows only when both did. */
        double *nv = realloc(*v, (size_t)c * sizeof *nv);
        if (!nv) return;
        *v = nv;
        int *ns = realloc(*s, (size_t)c * sizeof *ns);
        if (!ns) return;
        *s = ns;
        *cap = c;
    }
    (*v)[*n] = x;
    (*s)[(*n)++] = step;
}

void train_report_load(train_report *r, const char *text, size_t n) {
    for (size_t i = 0; i < n;) {
        size_t e = i;
        while (e < n && text[e] != '\n') e++;
        json_t *line = json_loadb(text + i, e - i, 0, NULL);
        json_t *step = json_object_get(line, "step"), *loss = json_object_get(line, "loss");
        json_t *val = json_object_get(line, "val_loss");
        if (json_is_integer(step) && json_is_number(loss))
            push(&r->train_loss, &r->train_step, &r->n_train, &r->cap_train, (int)json_integer_value(step),
                 json_number_value(loss));
        else if (json_is_integer(step) && json_is_number(val))
            push(&r->val_loss, &r->val_step, &r->n_val, &r->cap_val, (int)json_integer_value(step),
                 json_number_value(val));
        json_decref(line);
        i = e + 1;
    }
}

static void fmt_eta(char *buf, size_t n, double s) {
    if (!isfinite(s) || s < 0) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
    else snprintf(buf, n, "%ldm%02lds", t / 60, t % 60);
}

/* One line of metrics.jsonl, flushed; a failed write (a full disk) is an
 * error, not a silently torn file. */
/* v as JSON: null when it is NaN or Inf (JSON has no such numbers; a
 * skipped fp16 step's loss and norm are), else %.6f (fixed) or %.6g. */
static const char *json_num(char *buf, size_t n, double v, int fixed) {
    if (!isfinite(v)) return "null";
    snprintf(buf, n, fixed ? "%.6f" : "%.6g", v);
    return buf;
}

static loom_status metrics_line(FILE *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static loom_status metrics_line(FILE *f, const char *fmt, ...) {
    if (!f) return LOOM_OK;
    va_list ap;
    va_start(ap, fmt);
    int n = vfprintf(f, fmt, ap);
    va_end(ap);
    if (n < 0 || fflush(f) != 0 || ferror(f))
        return loom_error(LOOM_ERR_IO, "cannot write metrics.jsonl: %s (disk full?)", strerror(errno));
    return LOOM_OK;
}

loom_status train_report_step(train_report *r, FILE *metrics, int step, int total, double loss, float lr, double grad_norm,
                       double tok_per_s, double step_s, float loss_scale, int skipped, double eta_s) {
    push(&r->train_loss, &r->train_step, &r->n_train, &r->cap_train, step, loss);
    loom_mem_stats ms;
    loom_mem_get_stats(&ms);
    double mem_mib = (double)ms.current_total / (1 << 20);
    char loss_s[40], norm_s[40];
    LOOM_TRY(metrics_line(metrics, "{\"step\":%d,\"loss\":%s,\"lr\":%.6g,\"grad_norm\":%s,\"tok_per_s\":%.1f,"
                          "\"step_ms\":%.2f,\"mem_mib\":%.1f,\"loss_scale\":%g,\"skipped\":%d}\n",
                          step, json_num(loss_s, sizeof loss_s, loss, 1), (double)lr,
                          json_num(norm_s, sizeof norm_s, grad_norm, 0), tok_per_s, 1e3 * step_s, mem_mib,
                          (double)loss_scale, skipped));
    char eta[32];
    fmt_eta(eta, sizeof eta, eta_s);
    char line[256];
    snprintf(line, sizeof line, "step %d/%d | loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | mem %.0f MiB | ETA %s%s",
             step, total, loss, (double)lr, grad_norm, tok_per_s, mem_mib, eta, skipped ? " | skipped (inf)" : "");
    if (r->tty) {
        fprintf(stderr, "\r%-110s", line);
        r->line_open = 1;
    } else if (step % r->log_every == 0 || step == total || skipped) {
        fprintf(stderr, "%s\n", line);
    }
    return LOOM_OK;
}

void train_report_end_line(train_report *r) {
    if (r->line_open) fputc('\n', stderr);
    r->line_open = 0;
}

loom_status train_report_val(train_report *r, FILE *metrics, int step, double val_loss) {
    push(&r->val_loss, &r->val_step, &r->n_val, &r->cap_val, step, val_loss);
    char loss_s[40];
    LOOM_TRY(metrics_line(metrics, "{\"step\":%d,\"val_loss\":%s}\n", step,
                          json_num(loss_s, sizeof loss_s, val_loss, 1)));
    train_report_end_line(r);
    fprintf(stderr, "step %d: validation loss %.4f\n", step, val_loss);
    return LOOM_OK;
}

static void polyline(FILE *f, const double *y, const int *x, int n, double x0, double x1, double y0, double y1,
                     const char *color) {
    if (n == 0) return;
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"", color);
    for (int i = 0; i < n; i++) {
        if (!isfinite(y[i])) continue;
        double px = 60 + 560 * (x[i] - x0) / (x1 - x0 > 0 ? x1 - x0 : 1);
        double py = 20 + 300 * (1 - (y[i] - y0) / (y1 - y0 > 0 ? y1 - y0 : 1));
        fprintf(f, "%.1f,%.1f ", px, py);
    }
    fprintf(f, "\"/>\n");
}

loom_status train_report_plot(const train_report *r, const char *path) {
    if (r->n_train == 0) return loom_error(LOOM_ERR_INVALID, "plot: no steps");
    double y0 = INFINITY, y1 = -INFINITY;
    for (int i = 0; i < r->n_train; i++) if (isfinite(r->train_loss[i])) { y0 = fmin(y0, r->train_loss[i]); y1 = fmax(y1, r->train_loss[i]); }
    for (int i = 0; i < r->n_val; i++) { y0 = fmin(y0, r->val_loss[i]); y1 = fmax(y1, r->val_loss[i]); }
    if (!isfinite(y0)) return loom_error(LOOM_ERR_NUMERIC, "plot: no finite loss");
    double x0 = r->train_step[0], x1 = r->train_step[r->n_train - 1];
    /* Drawn in memory, then written atomically (temporary, fsync, rename). */
    char *svg = NULL;
    size_t svg_len = 0;
    FILE *f = open_memstream(&svg, &svg_len);
    if (!f) return loom_error(LOOM_ERR_NOMEM, "plot: out of memory");
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"640\" height=\"370\" font-family=\"sans-serif\" "
               "font-size=\"12\">\n<rect width=\"640\" height=\"370\" fill=\"white\"/>\n"
               "<rect x=\"60\" y=\"20\" width=\"560\" height=\"300\" fill=\"none\" stroke=\"#999\"/>\n");
    for (int k = 0; k <= 4; k++) {
        double v = y0 + (y1 - y0) * k / 4;
        fprintf(f, "<text x=\"55\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n", 324 - 300.0 * k / 4, v);
    }
    fprintf(f, "<text x=\"60\" y=\"340\">step %.0f</text><text x=\"620\" y=\"340\" text-anchor=\"end\">step %.0f</text>\n",
            x0, x1);
    polyline(f, r->train_loss, r->train_step, r->n_train, x0, x1, y0, y1, "#1f77b4");
    polyline(f, r->val_loss, r->val_step, r->n_val, x0, x1, y0, y1, "#d62728");
    fprintf(f, "<text x=\"340\" y=\"360\" fill=\"#1f77b4\">training loss</text>"
               "<text x=\"460\" y=\"360\" fill=\"#d62728\">validation loss</text>\n</svg>\n");
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    loom_status st = bad ? loom_error(LOOM_ERR_NOMEM, "plot: out of memory") : loom_file_write_atomic(path, svg, svg_len);
    free(svg);
    return st;
}
