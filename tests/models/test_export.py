"""`vapo export`: a finished run's checkpoint to Hugging Face format, after the fact."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from tests.helpers import build_tokenizer, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.cli import main


@pytest.mark.slow
def test_export_writes_the_checkpoints_policy_and_critic(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    module = tiny_module(tok, val_before_train=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[ckpt]).fit(module, datamodule=tiny_data(tmp_path))
    main(
        [
            "export",
            "--ckpt_path",
            str(tmp_path / "checkpoints" / "last.ckpt"),
            "--out",
            str(tmp_path / "hf"),
        ]
    )
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "policy")
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "hf" / "critic")
    for exported, trained in ((policy, module.policy), (critic, module.critic)):
        got, want = exported.state_dict(), trained.state_dict()
        assert want.keys() <= got.keys()
        assert all(torch.equal(got[k], want[k].cpu()) for k in want)  # the trained weights
    assert AutoTokenizer.from_pretrained(tmp_path / "hf" / "policy").eos_token_id is not None


@pytest.mark.slow
def test_a_weights_only_checkpoint_exports_and_refuses_to_resume(tmp_path, capsys):
    """`ModelCheckpoint(save_weights_only=True)`: a third of the size of a full checkpoint
    (no AdamW moments), `vapo export` reads it, and `vapo fit --ckpt_path` refuses it in one
    line before any work. The time each save took is logged as `timing_s/checkpoint`."""
    import pytest

    from tests.helpers import scalars
    from vapo_lightning.checkpoint import AtomicCheckpointIO

    tok = build_tokenizer(tmp_path / "tok")
    module = tiny_module(tok, val_before_train=False)
    full = ModelCheckpoint(dirpath=tmp_path / "full", save_last=True, save_top_k=0, every_n_train_steps=1)
    light = ModelCheckpoint(
        dirpath=tmp_path / "light", save_last=True, save_top_k=0, every_n_train_steps=2, save_weights_only=True
    )
    tiny_trainer(
        tmp_path, max_steps=2, callbacks=[full, light], plugins=[AtomicCheckpointIO()], limit_val_batches=0
    ).fit(module, datamodule=tiny_data(tmp_path))
    weights = sum(p.numel() * 4 for m in (module.policy, module.critic) for p in m.parameters())
    sizes = {name: (tmp_path / name / "last.ckpt").stat().st_size for name in ("full", "light")}
    assert weights < sizes["light"] < 1.2 * weights + 200_000 and sizes["full"] > 2.9 * weights
    saved = scalars(tmp_path)["timing_s/checkpoint"]
    assert [step for step, _ in saved] == [0, 1] and all(s > 0 for _, s in saved)

    main(["export", "--ckpt_path", str(tmp_path / "light" / "last.ckpt"), "--out", str(tmp_path / "hf")])
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "policy")
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in module.policy.state_dict().items())
    with pytest.raises(SystemExit):
        main(
            [
                "fit",
                "-c",
                str(Path(__file__).parents[2] / "configs/tiny_cpu.yaml"),
                f"--ckpt_path={tmp_path / 'light' / 'last.ckpt'}",
                f"--trainer.default_root_dir={tmp_path / 'resumed'}",
            ]
        )
    err = capsys.readouterr().err
    assert "holds weights only (ModelCheckpoint save_weights_only): it cannot resume" in err
    assert not (tmp_path / "resumed").exists()
