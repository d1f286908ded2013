#!/usr/bin/env python3
"""Writes seed inputs for the fuzz targets into corpus/<target>/ (see README.md).

model_open: a valid tiny FoX checkpoint (the target's TINY_CONFIG: vocab 16, hidden 16,
1 layer, 2 heads of 8, MLP width 256) as f32 and bf16 safetensors (mode byte 0), and the
same with its config.json inline (mode byte 1).
attention_desc: a few descriptors (the target reads bytes front to back).
tokenizer_files: each of the target's tiny tokenizer files (mode bytes 0-5), and a tiny
byte-level BPE tokenizer.json.
weight_blocks: Q8 / Q4 matrices of valid blocks and one f16 matrix, with activations.
quantized_model: one input per base (Q8, Q4) and damage mode; the target builds the valid
quantized files itself, so the seeds only steer it (no edits, one edit, a header, a
metadata entry)."""
import json, os, random, struct, sys

here = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(0)

V, D, H, I = 16, 16, 2, 256
shapes = {
    "model.embeddings.weight": [V, D],
    "model.norm.weight": [D],
    "lm_head.weight": [V, D],
}
p = "model.layers.0."
shapes.update({
    p + "attn_norm.weight": [D],
    p + "attn.q_proj.weight": [D, D],
    p + "attn.k_proj.linear.weight": [D, D],
    p + "attn.k_proj.shift_proj.weight": [H, D],
    p + "attn.v_proj.linear.weight": [D, D],
    p + "attn.v_proj.shift_proj.weight": [H, D],
    p + "attn.o_proj.weight": [D, D],
    p + "attn.fgate_proj.weight": [H, D],
    p + "attn.fgate_proj.bias": [H],
    p + "attn.ogate_proj.weight": [D, D],
    p + "attn.output_norm.weight": [D],
    p + "attn.q_norm.weight": [D],
    p + "attn.k_norm.weight": [D],
    p + "mlp_norm.weight": [D],
    p + "mlp.gate_proj.weight": [2 * I, D],
    p + "mlp.down_proj.weight": [D, I],
})

def safetensors(dtype):
    header, blobs, off = {}, [], 0
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        norm = name.endswith("norm.weight")
        vals = [1.0 if norm else rng.gauss(0, 0.2) for _ in range(n)]
        if dtype == "F32":
            blob = struct.pack("<%df" % n, *vals)
        else:  # BF16: top half of the f32 bits
            blob = b"".join(struct.pack("<f", v)[2:] for v in vals)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)

config = json.dumps({
    "vocab_size": V, "hidden_size": D, "num_hidden_layers": 1, "num_heads": H,
    "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish", "norm_eps": 1e-6,
    "qk_norm": True, "qk_norm_share_param_across_head": False, "use_k_shift": True,
    "use_v_shift": True, "use_output_gate": True, "ogate_act": "sigmoid",
    "use_output_norm": True, "fgate_type": "full", "use_rope": False,
    "log_pruning_tolerance": None, "num_kv_heads": None, "window_size": None,
    "tie_word_embeddings": False}).encode()

def write(target, name, data):
    d = os.path.join(here, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)

f32, bf16 = safetensors("F32"), safetensors("BF16")
write("model_open", "tiny_f32", b"\x00" + f32)
write("model_open", "tiny_bf16", b"\x00" + bf16)
write("model_open", "tiny_inline_config", b"\x01" + struct.pack("<H", len(config)) + config + f32)

# attention_desc: batch, heads_kv, group, extra-head, seq_k, seq_q, seq_q-min, head_dim idx,
# layout, dtype, out_dtype, backend, flags, acp_mode, block_q, block_k, n acp values, ...
base = bytes([1, 1, 1, 1, 20, 9, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 0])
write("attention_desc", "dense_f32", base + bytes(rng.randrange(256) for _ in range(4000)))
acp = bytearray(base)
acp[12] = 8 | 16  # acp_values and seq_start
acp[13] = 1       # FX_ACP_THRESHOLD
acp[16] = 2
write("attention_desc", "acp_threshold", bytes(acp) + bytes([40, 40, 3]) + bytes(rng.randrange(256) for _ in range(4000)))
hf = bytearray(base)
hf[8], hf[9], hf[10] = 1, 1, 2
write("attention_desc", "head_first_f16_bf16", bytes(hf) + bytes(rng.randrange(256) for _ in range(4000)))

def byte_char(b):
    printable = lambda x: 0x21 <= x <= 0x7E or 0xA1 <= x <= 0xAC or 0xAE <= x <= 0xFF
    if printable(b):
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if not printable(x)))

tok_vocab = {byte_char(b): b for b in range(256)}
tok_vocab.update({"he": 256, "ll": 257, "hell": 258, "<|end|>": 259})
tok_merges = "#version: 0.2\nh e\nl l\nhe ll\n"
tok_config = json.dumps({"add_bos_token": True, "bos_token": "<|end|>", "eos_token": "<|end|>",
                         "tokenizer_class": "JSONGPT2Tokenizer"})
tok_json = json.dumps({
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [{"id": 259, "content": "<|end|>", "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True}],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None,
              "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
              "byte_fallback": False, "vocab": tok_vocab, "merges": ["h e", "l l", "he ll"]}})
vj = json.dumps(tok_vocab).encode()
write("tokenizer_files", "vocab", b"\x00" + vj)
write("tokenizer_files", "merges", b"\x01" + tok_merges.encode())
write("tokenizer_files", "tokenizer_json", b"\x02" + tok_json.encode())
write("tokenizer_files", "config", b"\x03" + tok_config.encode())
write("tokenizer_files", "special_map", b"\x04" + json.dumps({"bos_token": "<|end|>"}).encode())
write("tokenizer_files", "vocab_and_merges",
      b"\x05" + struct.pack("<H", len(vj)) + vj + tok_merges.encode())
# weight_blocks: format (0 f32 .. 3 q8, 4 q4), out, inp (u16), rows, flags, then weight
# bytes and activations. Q8 / Q4 seeds hold valid blocks (f16 scale 0x2c00 = 1/16).
def blocks(fmt, out, inp):
    unit, n = (34, 32) if fmt == 3 else (18, 16)
    blk = struct.pack("<H", 0x2C00) + bytes(rng.randrange(256) for _ in range(n))
    return blk * (out * -(-inp // 32))
for fmt, out, inp in [(3, 17, 64), (4, 17, 96), (3, 5, 40), (4, 33, 256)]:
    head = bytes([fmt, out]) + struct.pack("<H", inp) + bytes([3, 2])
    act = bytes(rng.randrange(224) for _ in range(3 * inp))
    write("weight_blocks", "q%d_%dx%d" % (8 if fmt == 3 else 4, out, inp), head + blocks(fmt, out, inp) + act)
head = bytes([1, 9]) + struct.pack("<H", 40) + bytes([2, 2])
write("weight_blocks", "f16_9x40", head + bytes(rng.randrange(256) for _ in range(9 * 40 * 2 + 80)))
# quantized_model: byte 0 = base (bit 0) | damage mode (bits 1-2); byte 1 = options.
for base in (0, 1):
    name = "q8" if base == 0 else "q4"
    write("quantized_model", name + "_intact", bytes([base]))
    write("quantized_model", name + "_edit", bytes([base]) + struct.pack("<IB", 300, 0x40))
    write("quantized_model", name + "_cut", bytes([base]) + struct.pack("<I", 1000))
    entry = json.dumps({"format": name, "layout": "packed16", "shape": [16, 16]}).encode()
    write("quantized_model", name + "_entry", bytes([base | 4, 3]) + entry)
    write("quantized_model", name + "_as_q4", bytes([base, 5]))
write("quantized_model", "header", bytes([2]) + json.dumps(
    {"__metadata__": {"x": json.dumps({"format": "q8", "layout": "packed16", "shape": [16, 16]})},
     "x": {"dtype": "U8", "shape": [1088], "data_offsets": [0, 1088]}}).encode())
print("seeds written under", os.path.join(here, "corpus"))
