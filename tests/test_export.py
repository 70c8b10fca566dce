"""`vapo export`: a finished run's checkpoint to Hugging Face format, after the fact."""

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from tests.helpers import build_tokenizer, tiny_data, tiny_module, tiny_trainer
from vapo_lightning.cli import main


def test_export_writes_the_checkpoints_policy_and_critic(tmp_path):
    tok = build_tokenizer(tmp_path / "tok")
    module = tiny_module(tok, val_before_train=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, save_top_k=0)
    tiny_trainer(tmp_path, max_steps=2, callbacks=[ckpt]).fit(
        module, datamodule=tiny_data(tmp_path)
    )
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
