/*
 * loom/checkpoint.h — model directories (Hugging Face layout) and training
 * checkpoints.
 *
 * A model directory holds `config.json` (Hugging Face LlamaConfig fields),
 * `model.safetensors` (Hugging Face LLaMA tensor names) and, when known,
 * `tokenizer.json` (loom's BPE, or the Hugging Face tokenizer.json it was
 * trained with, copied as it is). Standard LLaMA loaders read the first two.
 *
 * A training checkpoint is a model directory plus `state.safetensors`: fp32
 * masters (a frozen bf16 weight, which has none, as its bf16 values), AdamW
 * moments, and metadata (step, RNG, data position, loss scaler). Every
 * checkpoint is written into a temporary directory, each file
 * fsynced, then renamed into place: a crash or a full disk never leaves a
 * torn checkpoint, and an existing checkpoint is never modified.
 */
#ifndef LOOM_CHECKPOINT_H
#define LOOM_CHECKPOINT_H

#include "loom/nn.h"
#include "loom/optim.h"
#include "loom/io.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Read config.json (Hugging Face names: hidden_size, num_hidden_layers,
 * num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
 * max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings,
 * rope_scaling: null, "default", "linear" (factor), "llama3" (factor,
 * low_freq_factor, high_freq_factor, original_max_position_embeddings) or
 * "longrope" / "su" (Phi-3 and LLaMA models: short_factor and long_factor,
 * rotary size / 2 each; original_max_position_embeddings at the top of the
 * file (Phi-3's, 4096 when absent) or, for LLaMA, in rope_scaling; the
 * attention_factor where given, else Hugging Face's sqrt(1 + ln s /
 * ln original), s the file's context over the original (or rope_scaling's
 * factor, for LLaMA without the top-level field); max_seq stops at the
 * original context, below which Hugging Face uses the short factors, and
 * a saved config says the file's contexts again (loom's as
 * max_position_embeddings when it extends to none); a factor that is not the ratio of two
 * whole contexts reads back within a float's rounding of it);
 * "dynamic" (any model but Phi-3: factor; the default frequencies, which
 * Hugging Face's dynamic NTK scaling keeps up to max_position_embeddings,
 * loom's context; an original context other than that is refused);
 * "yarn" (any model but Phi-3: factor, else the file's context over the
 * original; original_max_position_embeddings, else the file's context;
 * attention_factor, else 0.1 ln(factor) + 1, or the ratio of mscale's and
 * mscale_all_dim's when both are given; beta_fast 32, beta_slow 1 and
 * truncate true unless said; the context the file's; saved with every
 * parameter, the attention factor included);
 * or transformers v5's rope_parameters, which holds rope_theta and the
 * scaling, and must agree with them when a file has both).
 * Optional fields absent from the file take LlamaConfig's defaults:
 * num_key_value_heads = num_attention_heads (also when null), max_position_embeddings 2048,
 * rope_theta 10000, rms_norm_eps 1e-6, tie_word_embeddings false, no
 * rope_scaling (Qwen2Config's for a "qwen2" file: 32 kv heads, 32768
 * positions; GemmaConfig's for "gemma": 16 kv heads, 8192 positions, head_dim
 * 256, tied). model_type may be "llama", "mistral", "qwen2", "qwen3",
 * "gemma", "gemma2", "gemma3_text", "gemma3", "granite", "phi3" or "smollm3". sliding_window is
 * computed as a window (sliding_window, window_from,
 * window_global_interval): Mistral's (4096 when a "mistral" file leaves it
 * out) and Phi-3's on every block, Gemma 2's (4096) on every other block
 * from the first, Qwen 2's and Qwen 3's (4096) only with
 * use_sliding_window and on the blocks from max_window_layers (28) on,
 * Gemma 3's below; a layer_types list ("sliding_attention" /
 * "full_attention" a block) says the blocks for the classes that read one
 * (Gemma 2's and 3's, Qwen 2's and 3's; not Mistral's or Phi-3's), and one
 * that is not such a pattern is refused, as is SmolLM3's window (on its
 * NoPE blocks). LLaMA's, Gemma's and Granite's classes have no window: a
 * sliding_window in their files is not read. The context (max_seq) is the
 * file's; a config with a window saves it as its class reads it (LLaMA's
 * layout as MistralForCausalLM). "qwen2" puts biases on q, k and v
 * (qkv_bias); LLaMA's attention_bias (read for "llama" or no model_type:
 * Mistral's model has none) on q, k, v and o. A head_dim other than
 * hidden_size / num_attention_heads (Mistral NeMo's) is the heads' own
 * size (q and o then num_attention_heads x head_dim wide), and is saved.
 * "qwen3" normalizes each query and key head (qk_norm: q_norm, k_norm of
 * head_dim, before RoPE), reads attention_bias as LLaMA's, and defaults to
 * Qwen3Config's head_dim 128 and 32 kv heads; it saves as Qwen 3's, its
 * head_dim always written. "gemma" is Gemma's model (norm_unit_offset and
 * scale_embeddings) with the MLP activation its hidden_activation names,
 * else the tanh GELU (which Gemma 1.0's files call hidden_act "gelu"); it
 * saves as GemmaForCausalLM with hidden_activation and head_dim written.
 * "granite" reads Granite's embedding_multiplier, residual_multiplier,
 * attention_multiplier and logits_scaling (GraniteConfig's 1 each when
 * left out: its scores' scale is then 1, not 1/sqrt(head size)); a config
 * with any of them saves as GraniteForCausalLM with all four. "phi3"
 * (Phi-3's, Phi-4's) is LLaMA's model in files that fuse q, k, v into
 * self_attn.qkv_proj.weight and gate, up into mlp.gate_up_proj.weight
 * (fused_proj: loom_llama_save_weights writes them so, and the loaders
 * read each part's rows), with no attention biases whatever the file
 * says and Phi3Config's rms_norm_eps 1e-5 and 4096 positions by default;
 * partial_rotary_factor (Phi-4-mini's 0.75; at the top of the file or in
 * v5's rope_parameters) turns only int(head size x factor) of each head
 * (loom_llama_rotary_dim; longrope's factors count half of that), other
 * models' classes having none; resid_pdrop or embd_pdrop other than 0 are
 * refused by name; it saves as Phi3ForCausalLM. "smollm3" is
 * LLaMA's with every N-th block without RoPE (nope_interval: its
 * no_rope_layers, 0 at every N-th block, or no_rope_layer_interval, 4 by
 * default; another pattern is refused), SmolLM3Config's 4 kv heads, 32768
 * positions, rope_theta 2e6 and tied embeddings by default (and
 * use_sliding_window refused); it saves as SmolLM3ForCausalLM with
 * its list (one without a NoPE block as LLaMA's, the same model).
 * "gemma2" is Gemma's with post_norms (a norm of each block's attention and
 * MLP outputs: post_attention_layernorm and post_feedforward_layernorm,
 * the MLP's input norm then pre_feedforward_layernorm), the scores scaled
 * by query_pre_attn_scalar^-0.5 and softcapped at attn_logit_softcapping,
 * the logits at final_logit_softcapping (Gemma2Config's 256, 50 and 30
 * when absent, and 4 kv heads; a softcap of null is none), its
 * hidden_activation alone,
 * and its sliding_window (4096) on every other block; it saves as
 * Gemma2ForCausalLM with those fields and its window (without one, the
 * context as its window and layer_types every block full, which
 * transformers can run). use_bidirectional_attention (EmbeddingGemma's) is
 * refused for any model_type. Gemma 3's v5 files give rope_parameters per
 * layer type: full_attention's is read as the RoPE, sliding_attention's
 * theta as the local base.
 * "gemma3_text" (Gemma 3's text model) is Gemma 2's with qk_norm (its
 * q/k norms scaling by 1 + weight too), no softcaps unless the file says,
 * Gemma3TextConfig's defaults (rope_theta 1e6, 4 kv heads, 131072
 * positions, head_dim 256, tied), its window (4096) on every block but
 * every sliding_window_pattern-th (6; or layer_types), and those blocks
 * rotating with the plain RoPE of rope_local_base_freq (10000,
 * rope_local_theta); it saves as Gemma3ForCausalLM with both the pattern
 * and layer_types. A Gemma 3 without a window is refused. Its shape
 * fields (hidden_size, num_hidden_layers, num_attention_heads,
 * intermediate_size, vocab_size) take Gemma3TextConfig's defaults too
 * (2304, 26, 8, 9216, 262208); other model types require them. A
 * multimodal "gemma3" file (Gemma3ForConditionalGeneration: the 4B, 12B,
 * 27B) is read as its text model: its text_config as a "gemma3_text" file
 * (all defaults without one), its vision_config not at all; refused there
 * (LOOM_ERR_UNSUPPORTED), as transformers versions read them differently:
 * a tie_word_embeddings other than true outside text_config alone, and a
 * final_logit_softcapping.
 * hidden_act (any model_type): "silu", or the tanh GELU as
 * "gelu_pytorch_tanh" or "gelu_new" (act).
 * Save writes rope_scaling as Hugging Face's files do ("type": "linear" and
 * factor; "rope_type": "llama3" and its four numbers; "type": "longrope",
 * its factor lists, and attention_factor when it is not the one the
 * contexts give) when there is one,
 * and a model with biases on q, k and v alone as Qwen 2's
 * (Qwen2ForCausalLM, model_type "qwen2"), any other as LLaMA's with its
 * attention_bias.
 * Errors: LOOM_ERR_IO, LOOM_ERR_FORMAT (naming the file and the field),
 * LOOM_ERR_UNSUPPORTED (mlp_bias, another activation (the exact GELU among
 * them), another rope_scaling,
 * another model_type). An attention_dropout is kept, and applied by a
 * training forward. */
loom_status loom_llama_config_load(const char *path, loom_llama_config *cfg);
loom_status loom_llama_config_save(const loom_llama_config *cfg, loom_dtype weights_dtype, const char *path);

/* Write weights as safetensors with Hugging Face names, stored in dtype dt
 * (from the fp32 masters, gathered over the TP group; a LoRA model's
 * adapters merged into the weights they adapt, W + s B A (s: loom_lora_scale;
 * with DoRA each row scaled to its magnitude: loom_llama_param_merged), and
 * not written themselves; a frozen bf16 weight without an adapter, which
 * has no master, as its exact bf16 values), one tensor at a time as the
 * file is written. Atomic. path NULL: only take part in the gathers (a
 * rank that writes the file joins them all even when it fails). */
loom_status loom_llama_save_weights(loom_llama *m, loom_dtype dt, const char *path);
/* Load weights (any float dtype in the file) into masters and compute
 * copies (a frozen bf16 weight's compute copy alone; a LoRA model's own
 * weights, its adapters left as they are but DoRA's magnitudes, reset to
 * the new weights' norms by loom_llama_dora_reset, a collective over a TP
 * group);
 * every parameter must be present with the model's shape (the
 * message names the tensor, the file and both shapes). lm_head.weight may be
 * absent when embeddings are tied. */
loom_status loom_llama_load_weights(loom_llama *m, const char *path);
/* The same from a model directory: its model.safetensors or, when there is
 * none, the files its model.safetensors.index.json maps the tensors to
 * (Hugging Face's layout for large models: {"weight_map": {name: file}}).
 * Errors as above, and LOOM_ERR_FORMAT for an index that is not JSON, has
 * no weight_map, lacks a tensor or names a file outside the directory. */
loom_status loom_model_dir_load_weights(loom_llama *m, const char *dir);

/* Write a model directory: config.json, model.safetensors (dtype dt), if
 * tokenizer_path is not NULL a copy of it as tokenizer.json, and m's
 * generation_config.json if it has one (a stale tokenizer.json or
 * generation_config.json in dir is removed when there is none to write).
 * The directory is created if needed. Every file is written in full beside the
 * old one before any old one is replaced, so a failure leaves the directory
 * as it was. The replacing itself (a rename per file) runs while the file
 * LOOM_MODEL_INCOMPLETE marks the directory, so a crash or a failed rename
 * there leaves a directory loom_model_dir_check refuses, never one read as
 * a mix of two saves. With tensor parallelism every TP rank calls it
 * (weights are gathered) and TP rank 0 writes; dir may be NULL on the
 * others, and the write's errors are returned on rank 0 alone (the others
 * return LOOM_OK once their part of the gathers is done), unlike
 * loom_lora_save_peft's. */
loom_status loom_model_dir_save(loom_llama *m, loom_dtype dt, const char *tokenizer_path, const char *dir);
#define LOOM_MODEL_INCOMPLETE ".save-incomplete"
/* A LoRA model's adapters as a PEFT adapter directory: adapter_model.safetensors
 * (fp32 masters, named base_model.model.<tensor>, as PEFT saves them: A,
 * B and DoRA's <module>.lora_magnitude_vector) and adapter_config.json
 * (peft_type LORA, r, lora_alpha, target_modules, lora_dropout,
 * use_rslora, use_dora, base_model_name_or_path = base_model or null); each file
 * written atomically, the directory created if needed. With tensor
 * parallelism every rank of the TP group calls it (the adapters are
 * gathered whole) and TP rank 0 writes: the write's errors are returned
 * on every rank of the group (the others' name rank 0 and give its
 * message). With ZeRO the masters must be whole
 * (loom_dist_optim_unshard_masters). When base_model is a Gemma 3
 * multimodal directory, the tensors are named as its weights name its
 * language model's modules (base_model.model.language_model.model.<…> or
 * base_model.model.model.language_model.<…>) and target_modules is a
 * pattern of those under both names (the second is the loaded model's in
 * transformers 4.52 and later, which PEFT matches), not the vision tower's
 * linears of the same names. A base_model that is not a directory with
 * weights (a Hub id) is a name only.
 * Errors: LOOM_ERR_INVALID (no
 * adapters), LOOM_ERR_UNSUPPORTED (loom_lora_peft_unwritable), LOOM_ERR_IO,
 * LOOM_ERR_NOMEM. */
loom_status loom_lora_save_peft(loom_llama *m, const char *dir, const char *base_model);
/* 1 when loom does not write m's adapters in PEFT's layout: a Phi-3 model
 * (fused_proj) whose adapters adapt q, k, v, gate or up apart, which PEFT
 * adapts as one fused module each (qkv_proj, gate_up_proj; separate
 * adapters would be one block-diagonal adapter of rank 3r there, which
 * loom does not write). Its merged model saves as any other. */
int loom_lora_peft_unwritable(const loom_llama *m);
/* A PEFT LoRA adapter directory's setting, from its adapter_config.json:
 * r, lora_alpha (PEFT's default 8), target_modules and lora_dropout.
 * target_modules selects modules by name as PEFT does: "all-linear"; a
 * list of names, each matching the modules it equals or ends after a '.'
 * ("v_proj", "self_attn.v_proj"); or a regular expression matching whole
 * names (model\.layers\.[0-9]+\.self_attn\.(q|v)_proj: the syntax
 * Python's and POSIX extended ones share; Python's escapes such as \d,
 * (?...) groups and counted repeats are refused, with what could make
 * the compiled pattern explode). It must select each of q_proj ..
 * down_proj in every layer or in none: here layers 0..127 are checked
 * (the model is not known); loom_lora_peft_config_layers checks a model of
 * n_layers, as loom_lora_load_peft does. Refusals as below. */
loom_status loom_lora_peft_config(const char *dir, loom_lora_config *c);
loom_status loom_lora_peft_config_layers(const char *dir, int n_layers, loom_lora_config *c);
/* Apply a PEFT LoRA adapter directory (adapter_config.json,
 * adapter_model.safetensors, any float dtype) to m: loom_llama_add_lora
 * with its setting (loom_lora_peft_config), or, when m has adapters
 * already (loom_llama_new_lora), the same rank, alpha, targets, use_rslora
 * and use_dora (else LOOM_ERR_INVALID; the dropout, a training setting, may
 * differ), then its A and B (and DoRA's magnitudes) into them. use_rslora
 * true is rsLoRA (the config's rslora), use_dora true DoRA (its dora, with
 * a <module>.lora_magnitude_vector tensor per linear). Refused by name
 * (LOOM_ERR_UNSUPPORTED):
 * fan_in_fan_out, a bias or lora_bias, modules_to_save, exclude_modules,
 * layers_to_transform, layer_replication, rank or alpha patterns, other
 * modules or some layers only (target_modules), and tensors that are not
 * those adapters. An adapter of a Gemma 3 multimodal base (its language
 * model's modules named as above) applies as one of the text model's; its
 * vision tower's and projector's tensors (PEFT adapts their q_proj ... too
 * when target_modules lists names) are passed over.
 * Errors also: LOOM_ERR_FORMAT (bad JSON, a missing tensor or one of
 * another shape, NaN), LOOM_ERR_IO, those of loom_llama_add_lora. After an
 * error past the setting's checks the model has adapters that may be
 * partly loaded: free it. Under tensor parallelism each rank reads the
 * files and keeps its part (no communication, but DoRA's norms for o and
 * down when it adds the adapters: every rank calls it). */
loom_status loom_lora_load_peft(loom_llama *m, const char *dir);
/* LOOM_ERR_STATE, naming what to do, when dir's files may be of two saves
 * (a writer stopped while replacing them). */
loom_status loom_model_dir_check(const char *dir);
/* The end-of-sequence token ids that dir's generation_config.json names
 * (eos_token_id: one id or a list, as Hugging Face writes it; Llama 3's
 * instruct models list <|eot_id|> there), into ids (room for cap), *n of
 * them: *n 0 when dir has no such file or it names none. Hugging Face's
 * generate stops at each; so does loom generate. Errors: LOOM_ERR_FORMAT
 * (not JSON, an id that is not an integer in [0, 2^31), more than cap),
 * LOOM_ERR_IO. */
loom_status loom_model_dir_eos_ids(const char *dir, int32_t *ids, int cap, int *n);
#define LOOM_GENERATION_CONFIG "generation_config.json"
/* The sampling dir's generation_config.json asks for, as Hugging Face's
 * generate reads it. The fields of *s the caller was given (bits of
 * `given`: 1 temperature, 2 top_p, 4 top_k) stay. Of the others: the
 * temperature is 0 (greedy) unless the file's do_sample is true, else its
 * temperature (1 when it says none); when that samples, top_p and top_k are
 * the file's (Hugging Face's 1 and 50 when it says none). Without the file
 * *s is left as it is. *from_file gets the bits of the fields set here, and
 * 8 when the decoding is greedy because do_sample is not true, and 16 for
 * its repetition_penalty (bit 16 of `given`: the caller's stays), which
 * applies greedy or not, and 32 for its min_p when that samples (bit 32 of
 * `given`: the caller's stays; none when the file says none). The file's
 * other fields (typical_p, ...) are not read, nor those not applied
 * checked. Errors: LOOM_ERR_FORMAT (as above, or an applied field
 * out of its range, named), LOOM_ERR_IO, LOOM_ERR_NOMEM. */
loom_status loom_model_dir_sampler(const char *dir, unsigned given, loom_sampler *s, unsigned *from_file);
#define LOOM_EOS_IDS_MAX 64 /* the most ids loom's readers take */
/* Give m dir's generation_config.json (checked as above; none when dir has
 * none), which loom_model_dir_save then writes with m's files, so that a
 * model made from another (a fine-tune of it, its checkpoints, an export)
 * stops generating where the original does. loom_model_dir_load calls it.
 * On an error m keeps what it had. Errors: those above, LOOM_ERR_NOMEM. */
loom_status loom_model_dir_load_generation_config(loom_llama *m, const char *dir);
/* Create a model from a directory (config.json + model.safetensors, or the
 * shards of model.safetensors.index.json) with the given precision (after
 * loom_model_dir_check). A Gemma 3 multimodal directory gives its text
 * model: the tensors of its language model, under the names of the
 * published files (language_model.model.<…>, language_model.lm_head.weight)
 * or of transformers' loaded model from 4.52 on (model.language_model.<…>,
 * lm_head.weight), which some files carry; the vision tower's and
 * projector's are not read. */
loom_status loom_model_dir_load(const char *dir, loom_precision prec, loom_llama **out);

/* How a GGUF file stores the model's matrices (norm weights are always
 * fp32). Q8_0 is ggml's 8-bit format: blocks of 32 values of a row as one
 * fp16 scale d = max|x| / 127 and 32 int8 round(x * (1 / d)) (half away
 * from zero, as ggml's reference quantizer); a matrix whose rows
 * are not a multiple of 32 long is stored in fp16 instead. */
typedef enum loom_gguf_type { LOOM_GGUF_F32, LOOM_GGUF_F16, LOOM_GGUF_BF16, LOOM_GGUF_Q8_0 } loom_gguf_type;
/* "q8_0" or a name loom_dtype_parse takes ("fp32", "bf16", ...) -> type,
 * case-insensitively; LOOM_ERR_INVALID naming the four. */
loom_status loom_gguf_type_parse(const char *name, loom_gguf_type *out);
/* "fp32", "fp16", "bf16", "q8_0"; "?" out of range. */
const char *loom_gguf_type_name(loom_gguf_type type);

/* Write the model as one GGUF file (version 3) that llama.cpp runs as its
 * "llama" architecture: hyperparameters as llama.* metadata, tok as a
 * byte-level BPE vocabulary ("gpt2" model, GPT-2's byte spelling,
 * "<|endoftext|>" as BOS and EOS, ids past the tokenizer's unused tokens),
 * matrices stored as `type`, under llama.cpp's tensor names, with each
 * head's q/k rows reordered for llama.cpp's adjacent-pair RoPE. The file's
 * directory is created if missing; the file is written atomically.
 * Errors: LOOM_ERR_INVALID (no tokenizer, one without "<|endoftext|>", one
 * with more tokens than the model, two tokens with the same bytes, which
 * llama.cpp cannot load; an unknown type), LOOM_ERR_FORMAT (a NaN or
 * infinite weight, named), LOOM_ERR_UNSUPPORTED (a tensor-parallel model, a
 * model with rope_scaling, a Hugging Face tokenizer: export a Hugging Face
 * directory and use llama.cpp's convert_hf_to_gguf.py), LOOM_ERR_IO,
 * LOOM_ERR_NOMEM. */
loom_status loom_llama_save_gguf(loom_llama *m, loom_gguf_type type, const loom_tokenizer *tok, const char *path);

/* Everything besides weights that resuming needs. */
typedef struct loom_train_state {
    int step;                         /* optimizer steps completed */
    uint64_t rng_seed, rng_offset;    /* the default RNG */
    loom_dataloader_position data;    /* next batch */
    float loss_scale;
    int scaler_good_steps;
    long scaler_skipped;
    uint64_t tokens_seen;
    int loss_scaling;                 /* 1: the run scaled its loss (fp16); -1 on load: not recorded */
    int batch, seq, grad_accum, dp_size; /* the data layout of the run; 0 on load: not recorded */
    /* The training shards then (0 and "" on load: not recorded): data.shard
     * indexes the sorted list, so a changed list moves the position. */
    int data_shards;
    char data_shard_name[256];        /* file name of shard data.shard */
    /* The run's optimizer settings as the trainer spells them, flag and value
     * pairs ("--steps 100 --lr 0.00100000005 --min-lr ... --warmup 10
     * --schedule cosine --decay-frac 0.2 --weight-decay ... --clip 1"), kept
     * to compare on resume; "" on load: not recorded. */
    char optimizer[512];
    /* The run's --init directory as an absolute path, kept from the first
     * run through its resumes (a LoRA adapter's base_model_name_or_path);
     * "" for none, or on load: not recorded. */
    char init_dir[1024];
} loom_train_state;

/* Write checkpoint `dir` (which must not exist yet; it is created through a
 * temporary sibling and renamed; st->loss_scale must be finite and at least
 * LOOM_LOSS_SCALE_MIN, 1 for a run without loss scaling, else
 * LOOM_ERR_INVALID and nothing is written): a model directory plus
 * state.safetensors
 * with fp32 masters (a frozen bf16 weight's bf16 values), the AdamW
 * moments adam_m[i], adam_v[i] (this rank's
 * shard of parameter i, numel floats each; not read for a frozen
 * parameter, which may pass NULL) and the state. A LoRA model's directory
 * holds the merged weights, its state the unmerged weights, the adapters'
 * masters and moments, and the LoRA setting (metadata "lora"). With tensor
 * parallelism every rank of the TP group calls it (tensors are gathered);
 * TP rank 0 writes. The files hold full tensors, whatever the layout. */
loom_status loom_checkpoint_save(const char *dir, loom_llama *m, float *const *adam_m, float *const *adam_v,
                                 int adam_steps, const loom_train_state *st, const char *tokenizer_path);
/* The same with the moments read through io (loom_dist_optim_moments_io):
 * each tensor of the state is fetched as it is written, so no rank holds a
 * second copy of the training state, whatever the layout. With ZeRO the
 * masters must be whole (loom_dist_optim_unshard_masters), only DP rank 0
 * of each TP rank calls it, and the other DP ranks call
 * loom_dist_optim_serve_moments at the same time. A save that fails on the
 * writing rank still takes part in every gather, so that no other rank is
 * left waiting in one; the error is returned there alone (the others
 * return LOOM_OK once their part is done: a caller that must know on every
 * rank shares it, as loom train ends the job with MPI_Abort). */
loom_status loom_checkpoint_save_io(const char *dir, loom_llama *m, const loom_moments_io *io, int adam_steps,
                                    const loom_train_state *st, const char *tokenizer_path);
/* Restore masters, compute copies (alone for a frozen bf16 weight), moments
 * and state from `dir` into a model of the same configuration (any TP
 * layout: each rank takes its shard).
 * Moments are not read for frozen parameters (adam_m[i] may be NULL). A
 * checkpoint of a LoRA run loads only into a model with the same adapters
 * (loom_llama_new_lora, or loom_llama_add_lora first), and one without into
 * a model without:
 * LOOM_ERR_INVALID, naming both settings. */
loom_status loom_checkpoint_load(const char *dir, loom_llama *m, float *const *adam_m, float *const *adam_v,
                                 int *adam_steps, loom_train_state *st);
/* The same with the moments written through io: into the optimizer's own
 * where it lends them, else one tensor at a time through io->set. Every
 * rank reads the files itself (no communication). With ZeRO the masters
 * must be whole while it runs (loom_dist_optim_unshard_masters before,
 * loom_dist_optim_reshard_masters after). */
loom_status loom_checkpoint_load_io(const char *dir, loom_llama *m, const loom_moments_io *io, int *adam_steps,
                                    loom_train_state *st);

/* Checkpoints in `out_dir` are named ckpt-NNNNNNNN (the step, zero-padded).
 * Remove all but the newest `keep`. */
loom_status loom_checkpoint_prune(const char *out_dir, int keep);
/* Remove only the temporaries of checkpoints (and of metrics.jsonl and
 * loss.svg) whose writer died (before a run writes its first checkpoint:
 * on a tight disk they would leave no room for it). */
void loom_checkpoint_remove_stale(const char *out_dir);
/* The highest step among out_dir's checkpoints (ckpt-NNNNNNNN), -1 when it
 * has none or cannot be read. */
int loom_checkpoint_newest_step(const char *out_dir);
/* The newest checkpoint directory in out_dir, into path (n bytes).
 * Errors: LOOM_ERR_IO when there is none. */
loom_status loom_checkpoint_latest(const char *out_dir, char *path, size_t n);

/* Create a directory and its parents (like mkdir -p). */
loom_status loom_mkdir_p(const char *dir);

#ifdef __cplusplus
}
#endif
#endif
