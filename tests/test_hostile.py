"""Input a hostile or careless user may give: each test failed on the code before its fix."""

import logging
import os
import pathlib
import sys

import pytest
import torch

from conftest import ROOT, load_experiment


class RunsCode:
    """Unpickling this object touches a file: what an attacker's training_state.pt would do, less harmlessly."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_resume_never_unpickles_code(experiment, tmp_path):
    """--resume read training_state.pt with weights_only=False: any code pickled into it ran."""
    folder = tmp_path / "step_000002"
    folder.mkdir()
    marker = tmp_path / "code_ran"
    torch.save({"step": 2, "payload": RunsCode(marker)}, folder / "training_state.pt")
    with pytest.raises(experiment.InputError, match="not loaded"):
        experiment.load_state_file(folder)
    assert not marker.exists()
    # a real state (plain data, tensors, RNG states) still loads
    import random
    torch.save({"step": 2, "data_position": [0, 8], "args": {"lr": 1e-4, "run_name": "r", "filter": []},
                "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}, folder / "training_state.pt")
    assert experiment.load_state_file(folder)["step"] == 2


def test_reward_fn_folder_does_not_shadow_installed_packages(experiment, tmp_path, monkeypatch):
    """--reward-fn put the working directory first on sys.path: a tqdm.py or peft.py there replaced the real one."""
    (tmp_path / "my_reward.py").write_text("def reward(completion, answer, metadata):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    function = experiment.load_reward_fn("my_reward:reward")
    assert function("x", "y", {}) == 1.0
    site = min(i for i, p in enumerate(sys.path) if "site-packages" in p)
    assert sys.path.index(str(tmp_path)) > site  # installed packages are found first


def test_search_corpus_skips_links_out_of_the_folder(tmp_path, caplog):
    """A symlink in --corpus-dir to a file outside it (/etc/passwd, say) was served to the model as a passage."""
    sys.path.insert(0, str(ROOT / "experiment_multiturn_qa"))
    try:
        import search
    finally:
        sys.path.remove(str(ROOT / "experiment_multiturn_qa"))
    corpus, secrets = tmp_path / "corpus", tmp_path / "secrets"
    corpus.mkdir()
    secrets.mkdir()
    (corpus / "notes.md").write_text("The lighthouse of Orrin Quade was built in 1893 on the northern cape.\n")
    (secrets / "passwd.txt").write_text("root:x:0:0:root:/root:/bin/bash secret line that must never be read\n")
    os.symlink(secrets / "passwd.txt", corpus / "passwd.txt")
    os.symlink(secrets, corpus / "linked_folder")
    with caplog.at_level(logging.WARNING):
        passages = search.load_passages(corpus)
    assert [p.source for p in passages] == ["notes.md"]
    assert not any("root:x" in p.text for p in passages)
    assert "leads outside the corpus folder" in caplog.text
