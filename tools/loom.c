/*
 * loom.c — the command-line entry point: dispatches to the subcommands.
 */
#include "cli.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const command *const commands[] = {&cmd_tokenize, &cmd_train, &cmd_eval, &cmd_generate, &cmd_export, &cmd_bench};
#define N_COMMANDS ((int)(sizeof commands / sizeof commands[0]))

static void usage(FILE *f) {
    fprintf(f, "usage: loom COMMAND [flags]\n\n"
               "loom trains LLaMA-family language models on the CPU with mixed precision\n"
               "(fp32 / bf16 / fp16, fp32 master weights and main_grad) and activation\n"
               "recomputation.\n\ncommands:\n");
    for (int i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-10s %s\n", commands[i]->name, commands[i]->summary);
    fprintf(f, "\nRun 'loom COMMAND --help' for a command's flags.\n"
               "\nEnvironment: LOOM_SIMD=portable|avx2|avx512f|avx512-bf16|native caps the kernels'\n"
               "instruction sets (default: native, all the CPU has; 'loom --version' names them).\n");
}

/* OpenMP threads that spin while they wait (libgomp's default) hold a core
 * for milliseconds after every parallel loop. On a machine shared with other
 * work that is ruinous: a thread spins at a barrier while its partner sits
 * descheduled, and a step can take several times as long. loom's commands
 * therefore wait passively unless the environment chooses (OMP_WAIT_POLICY
 * or GOMP_SPINCOUNT set). The runtime reads this when it starts, before
 * main, so the process re-executes itself once with the setting. */
static void prefer_passive_waits(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT")) return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
    execv("/proc/self/exe", argv); /* returns only on failure: carry on as we are */
}

/* LOOM_SIMD caps the kernel paths (loom_set_simd_level); the library
 * ignores a value it does not know, so the command line checks it. */
static int check_simd_env(void) {
    const char *level = getenv("LOOM_SIMD");
    if (!level || !*level || loom_set_simd_level(level) == LOOM_OK) return 0;
    fprintf(stderr, "loom: LOOM_SIMD: %s\n", loom_last_error());
    return 2;
}

int main(int argc, char **argv) {
    prefer_passive_waits(argv);
    if (check_simd_env()) return 2;
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("loom 0.1.0 (MPI: %s, kernels: %s)\n", loom_dist_built_with_mpi() ? "yes" : "no", loom_simd_name());
        return 0;
    }
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(argv[1], commands[i]->name)) return commands[i]->run(argc - 1, argv + 1);
    fprintf(stderr, "loom: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
