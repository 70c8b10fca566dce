"""`vapo convert-gguf`: a tiny Llama written as GGUF here (llama.cpp's tensor names, a byte-level
BPE in `tokenizer.ggml.*` form, tied embeddings, Q8_0 weights) converts into a folder whose
logits equal the GGUF-loaded model's; bad input stops in one line before any work."""

import json
import sys

import gguf  # the gguf extra, which the dev extra brings
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_lightning import convert_gguf
from vapo_lightning.cli import main
from vapo_lightning.convert_gguf import probe_sequences
from vapo_lightning.tokenization import CHAT_TEMPLATE, train_bpe

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def write_tiny_llama(path, seed=0):
    """A 2-layer Llama GGUF as llama.cpp's converter lays it out: no `output.weight` (the LM
    head is the embedding), the layers' matrices in Q8_0, norms in F32."""
    tok = train_bpe([f"{a} + {b} = {a + b}. The answer is {a * b}." for a in range(20) for b in range(9)], 300)
    backend = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(backend["vocab"], key=backend["vocab"].get)  # by id
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["merges"]]
    special = set(tok.all_special_tokens)
    head_dim = HIDDEN // HEADS

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL
    w.add_token_merges(merges)
    for name in ("bos", "eos", "pad", "unk"):
        getattr(w, f"add_{name}_token_id")(tokens.index(getattr(tok, f"{name}_token")))
    w.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def matrix(rows, cols):  # (rows, cols) as torch lays out a Linear weight
        return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)

    def q8(name, data):
        q8_0 = gguf.GGMLQuantizationType.Q8_0  # blocks of 32: row lengths are multiples of 32
        w.add_tensor(name, gguf.quants.quantize(data, q8_0), raw_dtype=q8_0)

    w.add_tensor("token_embd.weight", matrix(len(tokens), HIDDEN))
    for i in range(LAYERS):
        q8(f"blk.{i}.attn_q.weight", matrix(HIDDEN, HIDDEN))
        q8(f"blk.{i}.attn_k.weight", matrix(KV_HEADS * head_dim, HIDDEN))
        q8(f"blk.{i}.attn_v.weight", matrix(KV_HEADS * head_dim, HIDDEN))
        q8(f"blk.{i}.attn_output.weight", matrix(HIDDEN, HIDDEN))
        q8(f"blk.{i}.ffn_gate.weight", matrix(FFN, HIDDEN))
        q8(f"blk.{i}.ffn_up.weight", matrix(FFN, HIDDEN))
        q8(f"blk.{i}.ffn_down.weight", matrix(HIDDEN, FFN))
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + matrix(1, HIDDEN)[0])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + matrix(1, HIDDEN)[0])
    w.add_tensor("output_norm.weight", 1 + matrix(1, HIDDEN)[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf")


def test_a_gguf_converts_into_a_folder_with_the_same_logits(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "hf"
    main(["convert-gguf", str(tiny_gguf), str(out)])
    printed = capsys.readouterr().out
    assert "llama (LlamaForCausalLM), tied embeddings" in printed
    assert "dequantised from Q8_0 (14 tensors)" in printed and "chat template kept" in printed

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert "gguf" not in "".join(p.read_text().lower() for p in out.glob("*.json"))
    assert config["tie_word_embeddings"] is True
    generation = json.loads((out / "generation_config.json").read_text())

    ref = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name).eval()
    ref_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, not two copies
    assert tok.chat_template == CHAT_TEMPLATE
    for key in ("bos", "eos", "pad"):
        assert generation[f"{key}_token_id"] == getattr(ref_tok, f"{key}_token_id") is not None
    sequences = probe_sequences(ref_tok, ref.config.vocab_size)
    assert len(sequences) == 5 and all(len(ids) > 3 for ids in sequences)
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([ids])
            assert torch.equal(model(x).logits, ref(x).logits)
            assert tok.decode(ids) == ref_tok.decode(ids)


def test_a_file_that_is_not_a_gguf_is_one_line(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 a zip, not a gguf")
    with pytest.raises(SystemExit) as exit_:
        main(["convert-gguf", str(bad), str(tmp_path / "out")])
    message = str(exit_.value.code)
    assert message == f"vapo convert-gguf: error: {bad}: not a GGUF file (it starts with b'PK\\x03\\x04', not b'GGUF')"
    assert not (tmp_path / "out").exists()


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["convert-gguf", str(tmp_path / "nothing.gguf"), str(tmp_path / "out")])
    assert str(exit_.value.code) == f"vapo convert-gguf: error: {tmp_path / 'nothing.gguf'}: no such file"


def test_a_folder_that_is_not_empty_is_refused_before_any_work(tiny_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        main(["convert-gguf", str(tiny_gguf), str(out)])
    assert str(exit_.value.code) == f"vapo convert-gguf: error: {out}: not empty; give a new or empty folder"
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_architecture_transformers_cannot_read_is_named_with_the_ones_it_can(tmp_path):
    path = tmp_path / "rwkv.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SystemExit) as exit_:
        main(["convert-gguf", str(path), str(tmp_path / "out")])
    message = str(exit_.value.code)
    assert "\n" not in message and "cannot read GGUF architecture 'rwkv6'" in message
    assert "llama" in message.split("it reads ")[1]
    assert not (tmp_path / "out").exists()


def test_without_the_extra_the_error_names_it(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        main(["convert-gguf", str(tiny_gguf), str(tmp_path / "out")])
    assert str(exit_.value.code) == (
        "vapo convert-gguf: error: reading GGUF files needs accelerate: "
        "install the gguf extra, pip install -e '.[gguf]'"
    )


def test_a_saved_model_whose_logits_differ_is_refused_and_nothing_is_left(tiny_gguf, tmp_path, monkeypatch):
    check = convert_gguf.verify

    def verify_after_a_drift(model, tokenizer, folder):  # the saved weights no longer match
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.001)
        return check(model, tokenizer, folder)

    monkeypatch.setattr(convert_gguf, "verify", verify_after_a_drift)
    with pytest.raises(SystemExit) as exit_:
        main(["convert-gguf", str(tiny_gguf), str(tmp_path / "out")])
    message = str(exit_.value.code)
    assert message.startswith("vapo convert-gguf: error: the saved model's logits differ from")
    assert "\n" not in message and "(tolerance 0.0001)" in message
    assert list(tmp_path.iterdir()) == []  # neither OUT_DIR nor the folder written beside it
