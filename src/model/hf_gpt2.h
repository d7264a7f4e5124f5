// Hugging Face GPT-2 checkpoints: config.json, and the mapping between HF's GPT2LMHeadModel tensors (in a
// safetensors file, io/safetensors.h) and Loom's GptModel parameters, both ways.
//
// GPT-2 on the Hub (no "transformer." prefix there; the prefix is accepted and stripped on import):
//
//   HF tensor                       HF shape    Loom parameter                           Loom shape
//   wte.weight                      (V, h)      embedding.word_embeddings.weight          (Vp, h)  rows >= V zero
//   wpe.weight                      (P, h)      embedding.position_embeddings.weight      (P, h)
//   h.{i}.ln_1.{weight,bias}        (h)         layers.{i}.norm1.{weight,bias}            (h)
//   h.{i}.attn.c_attn.weight        (h, 3h)     layers.{i}.attention.qkv.weight           (3h, h)  transposed
//   h.{i}.attn.c_attn.bias          (3h)        layers.{i}.attention.qkv.bias             (3h)
//   h.{i}.attn.c_proj.weight        (h, h)      layers.{i}.attention.proj.weight          (h, h)   transposed
//   h.{i}.attn.c_proj.bias          (h)         layers.{i}.attention.proj.bias            (h)
//   h.{i}.ln_2.{weight,bias}        (h)         layers.{i}.norm2.{weight,bias}            (h)
//   h.{i}.mlp.c_fc.weight           (h, f)      layers.{i}.mlp.fc1.weight                 (f, h)   transposed
//   h.{i}.mlp.c_fc.bias             (f)         layers.{i}.mlp.fc1.bias                   (f)
//   h.{i}.mlp.c_proj.weight         (f, h)      layers.{i}.mlp.fc2.weight                 (h, f)   transposed
//   h.{i}.mlp.c_proj.bias           (h)         layers.{i}.mlp.fc2.bias                   (h)
//   ln_f.{weight,bias}              (h)         final_norm.{weight,bias}                  (h)
//   h.{i}.attn.bias, h.{i}.attn.masked_bias     causal-mask buffers, skipped
//   lm_head.weight                              tied to wte, skipped
//
// HF's Conv1D computes y = x W + b with W stored (in, out); Loom's Linear computes y = x W^T + b with W
// (out, in), hence the transposes. c_attn's output columns are [Q | K | V], each h wide and split into
// heads of d = h / a: after the transpose these are exactly the rows of Loom's qkv weight, whose rows are
// [Q heads | K heads | V heads] (layers.h, attention.h), so no re-interleaving is needed (Megatron's
// grouped layout would need one). Example, h = 4, a = 2: c_attn.weight[:, 0:2] is query head 0,
// [:, 2:4] query head 1, [:, 4:6] key head 0, ... = qkv.weight rows 0-1, 2-3, 4-5, ...
//
// Only GPT-2-shaped models map onto these tensors: LayerNorm, learned absolute positions, the GELU MLP
// (HF's gelu_new / gelu_pytorch_tanh, the tanh form Loom computes), biases, multi-head attention and the
// output layer tied to the embedding. Anything else is refused naming the flag that made it so.
//
// Parameter data may be float32 or bfloat16: every read and write goes through loom::convert.
#pragma once

#include "io/safetensors.h"
#include "model/gpt_model.h"

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::model {

// The GptConfig of the GPT-2 in <dir>/config.json: n_layer, n_embd, n_head, n_positions (or n_ctx; also
// the sequence length), vocab_size, layer_norm_epsilon (HF's default 1e-5), n_inner (null: 4 n_embd).
// activation_function must be gelu_new or gelu_pytorch_tanh; other values, or attention scaling Loom
// does not compute (scale_attn_weights false, scale_attn_by_inverse_layer_idx true), are refused
// naming the key.
GptConfig gpt_config_from_hf(const std::string & dir);

// Throws naming the flag (--normalization RMSNorm, --swiglu, --untie-embeddings-and-output-weights, ...)
// when `config` is not GPT-2-shaped. `action` says what was attempted ("import", "export").
void check_gpt2_architecture(const GptConfig & config, const std::string & action);

// Throws naming the model's flag and the key of <dir>/config.json when the model cannot hold the
// checkpoint: layers, hidden size, heads, ffn hidden size, positions and epsilon must be equal, and the
// checkpoint's vocabulary must fit the model's (--vocab-size; extra rows are zero).
void check_hf_gpt2_compatible(const GptConfig & checkpoint, const GptConfig & model, const std::string & dir);

// Loads <dir>/config.json and <dir>/model.safetensors into `model` (after or instead of model.init()).
// Every checkpoint tensor is used (save the skipped buffers) and every parameter filled, or it throws
// naming the tensor.
void load_hf_gpt2(GptModel & model, const std::string & dir);

// Writes <dir>/config.json and <dir>/model.safetensors (F32, Hub key names, the vocabulary cut to the
// model's unpadded vocab_size), each atomically; creates `dir` if needed.
void export_hf_gpt2(GptModel & model, const std::string & dir);

}  // namespace loom::model
