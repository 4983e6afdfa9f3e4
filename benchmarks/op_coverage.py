"""Op coverage on models nobody here wrote: per model, the ops that have no sharding rule and the
share of the forward FLOPs that run replicated (every rank computing them whole) under the
free plan on (4,) and (2, 2) H100 meshes.

    python -m benchmarks.op_coverage                  # every model
    python -m benchmarks.op_coverage --models resnet,vit

The models are built from their configurations (no downloads), on the meta device at the
sizes they train at (the vision models at their published widths on 64 images of 224 x 224,
the sequence models at widths 512-1024 on 32 x 512 tokens): Hugging Face's
vision (ResNet, ConvNeXt, EfficientNet, MobileNetV2, ViT, Swin), audio (Wav2Vec2, Whisper),
encoder (BERT) and encoder-decoder (T5, BART) models, torch.nn's Transformer, MultiheadAttention
and GRU / LSTM, the tests' ResNet (torchvision's layout; torchvision's CPU build does not
install beside torch's CPU wheel here), and the language models' Llama and GPT-2. The FLOPs are
the traced ops' forward FLOPs on whole shapes (solver/flops.py). The goal: 0% replicated on
every model with a batch. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.passes import strategies
from autopar.passes.strategies import OP
from autopar.passes.trace import trace
from autopar.solver.flops import op_flops
from autopar.zoo import hf_gpt2, hf_llama, lm_loss
from tests.models import ResNet

IMAGES, TOKENS, SEQ = 64, 32, 512
META = torch.device("meta")


def _images(size: int = 224, channels: int = 3):
    return (torch.empty(IMAGES, channels, size, size, device=META),
            torch.zeros(IMAGES, dtype=torch.long, device=META))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _classify(out, y):
    return F.cross_entropy(_logits(out), y)


def _hf_vision(kind: str, **fields):
    import transformers
    config = getattr(transformers, f"{kind}Config")(num_labels=1000, **fields)
    with META:
        model = getattr(transformers, f"{kind}ForImageClassification")(config)
    return model, _images(fields.get("image_size", 224)), _classify


class _Seq(nn.Module):
    """A sequence classifier around one torch.nn sequence module (batch first)."""

    def __init__(self, kind: str, width: int = 512):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.kind = kind
        if kind == "transformer":
            self.body = nn.Transformer(width, 8, 6, 6, 4 * width, dropout=0.0, batch_first=True)
        elif kind == "mha":
            self.body = nn.MultiheadAttention(width, 8, batch_first=True)
        elif kind == "gru":
            self.body = nn.GRU(width, width, 2, batch_first=True)
        else:
            self.body = nn.LSTM(width, width, 2, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        if self.kind == "transformer":
            h = self.body(h, h)
        elif self.kind == "mha":
            h = self.body(h, h, h, need_weights=False)[0]
        else:
            h = self.body(h)[0]
        return self.head(h)


VOCAB = 32000


def _tokens():
    x = torch.zeros(TOKENS, SEQ, dtype=torch.long, device=META)
    return x, x


def _lm(out, y):
    return lm_loss(_logits(out), y)


def _seq2seq(kind: str, **fields):
    import transformers
    config = getattr(transformers, f"{kind}Config")(vocab_size=VOCAB, pad_token_id=0,
                                                    decoder_start_token_id=0, **fields)
    with META:
        model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)

    class Wrapped(nn.Module):  # (input ids, decoder input ids) -> logits
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(input_ids=x, decoder_input_ids=x, use_cache=False).logits

    return Wrapped(), _tokens(), _lm


def _encoder(kind: str, **fields):
    import transformers
    config = getattr(transformers, f"{kind}Config")(vocab_size=VOCAB, **fields)
    with META:
        model = getattr(transformers, f"{kind}ForMaskedLM")(config)
    return model, _tokens(), _lm


def _audio(kind: str, head: str, **fields):
    import transformers
    config = getattr(transformers, f"{kind}Config")(num_labels=10, **fields)
    with META:
        model = getattr(transformers, f"{kind}{head}")(config)
    return model, (torch.empty(TOKENS, 16000, device=META),  # a second of 16 kHz audio
                   torch.zeros(TOKENS, dtype=torch.long, device=META)), _classify


def _whisper():
    """Whisper-base's shape: a log-mel spectrogram (80 x 3000) through two convolutions and
    the encoder, the decoder over 64 tokens; logits' cross-entropy."""
    import transformers
    config = transformers.WhisperConfig(vocab_size=VOCAB, d_model=512, encoder_layers=6,
                                        decoder_layers=6, encoder_attention_heads=8,
                                        decoder_attention_heads=8, encoder_ffn_dim=2048,
                                        decoder_ffn_dim=2048, pad_token_id=0,
                                        decoder_start_token_id=0, bos_token_id=None,
                                        eos_token_id=None, use_cache=False)
    with META:
        model = transformers.WhisperForConditionalGeneration(config)
    tokens = torch.zeros(TOKENS, 64, dtype=torch.long, device=META)

    class Wrapped(nn.Module):  # (features) -> logits over the fixed decoder tokens
        def __init__(self):
            super().__init__()
            self.inner = model
            self.register_buffer("tokens", tokens[:1], persistent=False)

        def forward(self, features):
            ids = self.tokens.expand(features.shape[0], -1)
            return self.inner(input_features=features, decoder_input_ids=ids).logits

    return Wrapped(), (torch.empty(TOKENS, 80, 3000, device=META), tokens), _lm


_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             intermediate_size=3072)


def _meta(make):
    with META:
        return make()


MODELS = {
    "resnet18": lambda: (_meta(lambda: ResNet(width=64, blocks=(2, 2, 2, 2), classes=1000)),
                         _images(), F.cross_entropy),
    "hf_resnet50": lambda: _hf_vision("ResNet"),
    "convnext_tiny": lambda: _hf_vision("ConvNext"),
    "efficientnet_b0": lambda: _hf_vision("EfficientNet"),
    "mobilenet_v2": lambda: _hf_vision("MobileNetV2"),
    "vit_base": lambda: _hf_vision("ViT", **_BASE),
    "swin_tiny": lambda: _hf_vision("Swin"),
    "wav2vec2_base": lambda: _audio("Wav2Vec2", "ForSequenceClassification", layerdrop=0.0,
                                    mask_time_prob=0.0,  # SpecAugment draws with numpy
                                    **_BASE),
    "whisper_base": _whisper,
    "bert_base": lambda: _encoder("Bert", **_BASE),
    "t5_small": lambda: _seq2seq("T5"),
    "bart_base": lambda: _seq2seq("Bart"),
    "nn_transformer": lambda: (_meta(lambda: _Seq("transformer")), _tokens(), lm_loss),
    "nn_mha": lambda: (_meta(lambda: _Seq("mha")), _tokens(), lm_loss),
    "nn_gru": lambda: (_meta(lambda: _Seq("gru")), _tokens(), lm_loss),
    "nn_lstm": lambda: (_meta(lambda: _Seq("lstm")), _tokens(), lm_loss),
    "llama_1b": lambda: (_meta(lambda: hf_llama(num_hidden_layers=16, hidden_size=2048,
                                                num_attention_heads=32, num_key_value_heads=8,
                                                intermediate_size=8192, vocab_size=VOCAB,
                                                max_position_embeddings=SEQ)),
                         _tokens(), lm_loss),
    "gpt2": lambda: (_meta(lambda: hf_gpt2(n_layer=12, n_embd=768, n_head=12, vocab_size=VOCAB,
                                           n_positions=SEQ)), _tokens(), lm_loss),
}


def forward_flops(model, example, loss_fn) -> dict[str, float]:
    """Every traced op's forward FLOPs on whole shapes, by node name."""
    x, y = example
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = trace(model, (x,), loss_fn, y)
        graph = strategies.build(program, (1,))
    return {n: op_flops(v, v.in_shapes, v.out_shapes) for n, v in graph.nodes.items()
            if v.kind == OP}


def coverage(name: str, shapes=((4,), (2, 2))) -> dict:
    """One model's row: ops without a rule, and per mesh the share of forward FLOPs its free
    plan runs replicated (or why it did not plan)."""
    model, example, loss_fn = MODELS[name]()
    flops = forward_flops(model, example, loss_fn)
    total = sum(flops.values()) or 1.0
    row = {"model": name, "ops": len(flops), "gflops": total / 1e9, "no_rule": set()}
    for shape in shapes:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = autopar.plan(model, autopar.MeshSpec(shape, hardware="h100"), example,
                                    loss_fn=loss_fn)
        except Exception as e:  # noqa: BLE001 (the row says why)
            row[shape] = f"error: {str(e).splitlines()[0][:80]}"
            continue
        whole = {o.name for o in plan.ops if o.replicated}
        row["no_rule"] |= {o.op for o in plan.ops if o.replicated == strategies.NO_RULE}
        share = sum(f for n, f in flops.items() if n in whole) / total
        row[shape] = f"{100 * share:.1f}% ({time.perf_counter() - start:.1f} s)"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    print("| model | ops | GFLOP fwd | replicated on (4,) | replicated on (2, 2) | ops without a "
          "rule |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        try:
            row = coverage(name)
        except Exception as e:  # noqa: BLE001 (a model that does not build or trace)
            print(f"| {name} | | | error: {str(e).splitlines()[0][:100]} | | |", flush=True)
            continue
        print(f"| {name} | {row['ops']} | {row['gflops']:.3f} | {row[(4,)]} | {row[(2, 2)]} | "
              f"{', '.join(sorted(row['no_rule'])) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
