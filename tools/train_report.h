/*
 * train_report.h — what `loom train` tells the person running it: a live
 * progress line on a terminal (plain lines otherwise), metrics as JSON lines,
 * and an SVG plot of training and validation loss at the end.
 */
#ifndef LOOM_TRAIN_REPORT_H
#define LOOM_TRAIN_REPORT_H

#include "loom/loom.h"

#include <stdio.h>

typedef struct train_report {
    int tty;
    int log_every;
    int line_open;
    double *train_loss; int *train_step; int n_train, cap_train;
    double *val_loss; int *val_step; int n_val, cap_val;
} train_report;

void train_report_init(train_report *r, int log_every);
void train_report_free(train_report *r);
loom_status train_report_step(train_report *r, FILE *metrics, int step, int total, double loss, float lr, double grad_norm,
                       double tok_per_s, double step_s, float loss_scale, int skipped, double eta_s);
loom_status train_report_val(train_report *r, FILE *metrics, int step, double val_loss);
/* The losses an earlier run logged: metrics.jsonl's n bytes of text (a
 * resumed run's plot covers its whole history). */
void train_report_load(train_report *r, const char *text, size_t n);
void train_report_end_line(train_report *r);
loom_status train_report_plot(const train_report *r, const char *path);

#endif
