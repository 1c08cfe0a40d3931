"""Small random models of the Hugging Face families Troupe reads, written by transformers
itself, as a user's Hub folder is: save_pretrained after a few training steps (so that
biases, norms and positions matter to the logits), and the model's logits on a batch.

usage: python hf_families.py OUT FAMILY...
For each FAMILY (llama3, llama-linear, mistral, mixtral, qwen2, qwen3, qwen3_moe, gpt2;
transformers 5: mixtral-fused, qwen3_moe-fused, its fused experts' layout on disk)
writes the folder OUT/FAMILY (llama3's with a tokenizer of its own) and OUT/FAMILY.pt (torch.save of {"tokens": (2, T) int64,
"logits": (2, T, vocab) float32}). A family this transformers lacks is left out and named
on stdout as "missing FAMILY". Exit 1 on any other failure.
"""
import os
import sys

import torch
import transformers

SEQ = 24  # the batch's tokens; the windows and Llama 3's original positions are shorter


def rotary(**extra):
    """A rotary family's common fields: 3 query heads per key/value head, vocab 300 (not
    a multiple of 128, so Troupe pads it), untied."""
    c = dict(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
             tie_word_embeddings=False)
    c.update(extra)
    return c


def families():
    t = transformers
    out = {
        # Llama 3.1's scaling: the head's lowest frequency interpolated, the others divided.
        "llama3": ("LlamaConfig", "LlamaForCausalLM",
                   rotary(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
        "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                         rotary(rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True)),
        "mistral": ("MistralConfig", "MistralForCausalLM", rotary(sliding_window=7)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                    rotary(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, router_jitter_noise=0.0)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", rotary(use_sliding_window=False, tie_word_embeddings=True)),
        # Qwen3: a head_dim of its own (16, not 48 / 6).
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", rotary(head_dim=16)),
        # Qwen3-MoE: dense block 1 (mlp_only_layers), top-2 of 4 experts not renormalised.
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      rotary(head_dim=16, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=1,
                             mlp_only_layers=[1])),
        # Real GPT-2's tanh GELU (gelu_new), Conv1D layout.
        "gpt2": ("GPT2Config", "GPT2LMHeadModel",
                 dict(vocab_size=300, n_embd=48, n_layer=2, n_head=4, n_positions=32, activation_function="gelu_new",
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }
    # transformers 5's fused experts on disk (save_original_format=False): (E, 2 I, H) and (E, H, I).
    if int(t.__version__.split(".")[0]) >= 5:
        out["mixtral-fused"] = out["mixtral"]
        out["qwen3_moe-fused"] = out["qwen3_moe"]
    return {name: (getattr(t, cfg, None), getattr(t, cls, None), kw) for name, (cfg, cls, kw) in out.items()}


def save_tokenizer(folder, vocab):
    """A word-level tokenizer of `vocab` pieces (tokenizer.json and its companions)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab):
        words["w%d" % i] = i
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(folder)


def main():
    out, names = sys.argv[1], sys.argv[2:]
    table = families()
    for name in names:
        if name not in table:
            print("missing", name)
            continue
        config_class, model_class, kwargs = table[name]
        if config_class is None or model_class is None:
            print("missing", name)
            continue
        torch.manual_seed(3)
        config = config_class(**kwargs)
        config._attn_implementation = "eager"
        model = model_class(config)
        vocab = config.vocab_size
        # A few steps on random tokens: every weight moves off its initial value.
        opt = torch.optim.Adam(model.parameters(), lr=2e-2)
        model.train()
        for _ in range(3):
            batch = torch.randint(0, vocab, (4, SEQ))
            loss = model(batch, labels=batch).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        if name.endswith("-fused"):
            model.save_pretrained(os.path.join(out, name), save_original_format=False)
        else:
            model.save_pretrained(os.path.join(out, name))
        if name == "llama3":  # a folder with its own tokenizer, as the Hub's have
            save_tokenizer(os.path.join(out, name), vocab)
        tokens = torch.randint(0, vocab, (2, SEQ))
        with torch.no_grad():
            logits = model(tokens).logits.float()
        torch.save({"tokens": tokens, "logits": logits.contiguous()}, os.path.join(out, name + ".pt"))
        print("wrote", name, type(model).__name__, transformers.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
