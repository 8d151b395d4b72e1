/*
 * rng_internal.h — the full Philox4x32 block function, private to loom.
 *
 * loom_philox4x32(seed, counter) is this function with the counter
 * {low(counter), high(counter), 0, 0} and the key {low(seed), high(seed)}.
 * It is exposed here (not in the public header) so that tests can check the
 * real implementation against the Random123 known-answer vectors, whose
 * counters use all four words.
 */
#ifndef LOOM_CORE_RNG_INTERNAL_H
#define LOOM_CORE_RNG_INTERNAL_H

#include <stdint.h>

/* Philox4x32 with `rounds` rounds (Random123 philox4x32_R): the key is bumped
 * by the Weyl constants between rounds. */
void loom_philox4x32_rounds(const uint32_t ctr[4], const uint32_t key[2], int rounds,
                            uint32_t out[4]);
/* Philox4x32-10, the generator loom uses. */
void loom_philox4x32_full(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

#endif
