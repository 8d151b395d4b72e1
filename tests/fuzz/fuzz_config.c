/*
 * fuzz_config.c — loom_llama_config_load (a Hugging Face config.json) on any
 * bytes: accepted or refused with a status, never a fault; an accepted
 * config passes loom_llama_config_validate.
 */
#include "fuzz_util.h"

#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write("config", data, size);
    loom_llama_config cfg;
    if (loom_llama_config_load(fuzz_path("config"), &cfg) == LOOM_OK && loom_llama_config_validate(&cfg) != LOOM_OK)
        abort();
    return 0;
}
