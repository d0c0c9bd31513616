"""Tiny random encoders saved as sentence-transformers saves them (no hub: the tokenizers are
trained here with `tokenizers`: WordPiece for BERT, Unigram for XLM-R, BPE for ModernBERT), and
cross-encoders saved as sentence_transformers.CrossEncoder loads them. Shared by
tests/model/test_encoders.py, tests/entrypoints and benchmarks/encoder_bench.py."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A retrieval pipeline embeds queries and documents and ranks them by similarity.",
    "Paris is the capital of France; Rome is the capital of Italy.",
    "Cross-encoders read the query and the document together and score the pair.",
    "Sentence embeddings are pooled from the encoder's final hidden states.",
    "ModernBERT alternates local and global attention layers with rotary positions.",
    "BERT uses absolute position embeddings and token type embeddings for sentence pairs.",
    "XLM-RoBERTa is a multilingual encoder trained on one hundred languages.",
    "how do I bake bread at home", "what is the weather like today in Berlin",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols , . ; : ! ? ( ) - ' \"",
]

# 16 texts of mixed length (1 to ~120 tokens).
TEXTS = [
    "Hello", "short one", "The capital of France is Paris.",
    "A retrieval pipeline embeds queries and documents, then ranks documents by cosine similarity to the query.",
    "what is the weather like today", "fox", "Cross-encoders score a query and a document read together.",
    " ".join(CORPUS), "bread", "Rome is the capital of Italy and Berlin is the capital of Germany.",
    "tokens " * 40, "ModernBERT alternates local and global attention.", "?", "numbers 1 2 3 4 5 6 7 8 9",
    " ".join(CORPUS[:4]), "the lazy dog sleeps",
]

QUERY = "what is the capital of France"
DOCS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.",
        "Rome is the capital of Italy.", "how do I bake bread at home", " ".join(CORPUS[:3])]


def _wordpiece(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 4, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.decoder = decoders.WordPiece()
    return tok, dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def _unigram(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok.train_from_iterator(CORPUS * 4, trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                                unk_token="<unk>"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    return tok, dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>", cls_token="<s>",
                     sep_token="</s>", mask_token="<mask>")


def _bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok, dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def make_tokenizer(kind: str, vocab_size: int = 400):
    """A transformers fast tokenizer for `kind` ("bert", "xlm_roberta", "modernbert")."""
    from transformers import PreTrainedTokenizerFast

    tok, specials = {"bert": _wordpiece, "xlm_roberta": _unigram, "modernbert": _bpe}[kind](vocab_size)
    names = ["input_ids", "token_type_ids", "attention_mask"] if kind == "bert" else ["input_ids", "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=names, model_max_length=512, **specials)


def make_config(kind: str, vocab_size: int, **overrides):  # noqa: D417
    """A tiny transformers config of `kind`."""
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig

    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  intermediate_size=96)
    if kind == "bert":
        cfg = BertConfig(**common, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0)
    elif kind == "xlm_roberta":
        cfg = XLMRobertaConfig(**common, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2)
    else:
        # local_attention 16: the longer test texts reach past the local window.
        cfg = ModernBertConfig(**common, max_position_embeddings=512, local_attention=16,
                               global_attn_every_n_layers=2, pad_token_id=3, cls_token_id=1, sep_token_id=2,
                               bos_token_id=1, eos_token_id=2)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (LayerNorms and biases included, which transformers'
    initialisation leaves at 1 and 0), so that a mix-up of any tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def save_sentence_transformer(kind: str, out: str, pooling: str = "cls", normalize: bool = True,
                              seed: int = 0, tokenizer=None, **config) -> str:
    """A random `kind` encoder and its tokenizer saved by sentence-transformers with a Pooling
    (`pooling`: "cls", "mean" or "lasttoken") and, with `normalize`, a Normalize module."""
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Normalize, Pooling, Transformer
    from transformers import AutoModel

    tokenizer = tokenizer or make_tokenizer(kind)
    raw = out + "-hf"
    torch.manual_seed(seed)
    config.setdefault("vocab_size", len(tokenizer))
    model = AutoModel.from_config(make_config(kind, **config), attn_implementation="sdpa")
    _randomize_(model, seed)
    model.save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    transformer = Transformer(raw)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(out)
    return out


def save_cross_encoder(kind: str, out: str, seed: int = 1, num_labels: int = 1, **config) -> str:
    """A random `kind` *ForSequenceClassification with one label (a cross-encoder) and its
    tokenizer, as sentence_transformers.CrossEncoder loads them."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = make_tokenizer(kind)
    torch.manual_seed(seed)
    cfg = make_config(kind, len(tokenizer), num_labels=num_labels, **config)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa")
    _randomize_(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def st_embeddings(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    return st.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def ce_scores(path: str, query: str, docs: list[str]) -> list[float]:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(path, device="cpu", num_labels=1)
    return [float(s) for s in ce.predict([(query, d) for d in docs])]


@contextlib.contextmanager
def env_offline() -> Iterator[None]:
    """sentence-transformers and transformers without the hub (none is reachable) while a test
    module runs, restored after it: the variables must not leak into the worker's other tests
    (tests/model/test_hub.py's subprocesses inherit os.environ)."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
