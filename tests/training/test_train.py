"""`specula train` and its parts on tiny models: a training step lowers the loss, training is
deterministic with a seed and resumes from a checkpoint to the same weights, the training-time
test mask shows each row what drafting shows it, and the command writes a head that
`--method eagle` then uses (greedy output unchanged)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tiny import reference_greedy, saved_training_setup, tiny_model
from specula.drafters.heads.runtime import new_head
from specula.errors import ConfigError
from specula.models.native import NativeCausalLM, NativeDecoder, configure
from specula.training.corpus import CorpusEntry
from specula.training.features import (
    FeatureSet, Rows, concat_features, coverage, draft_vocabulary, extend_vocabulary, extract_features, token_counts,
)
from specula.drafters.heads.losses import LossConfig, distill, loss_of, soft_ce, topk_ce, ttt_mask
from specula.training.trainer import (LENGTH_WINDOW, TrainConfig, batch, batch_order, chunks, loss_config, split,
                                      split_tokens, step_counts, train_head)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model("llama", "eager", seed=3)
    target = NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                            eos_token_ids=[])
    rng = random.Random(0)
    corpus = []
    for i in range(10):
        p = [rng.randrange(2, 96) for _ in range(6)]
        corpus.append(CorpusEntry(str(i), p, reference_greedy(model, p, 30)))
    fs = extract_features(target, corpus, tmp_path_factory.mktemp("f") / "f.safetensors")
    layered = extract_features(target, corpus, tmp_path_factory.mktemp("f") / "f.safetensors", layers=(0, 1))
    return target, fs, layered


def test_layer_features_are_cached_with_the_last_state(setup, tmp_path):
    """eagle3's features: the inputs of its layers next to the final-normed state (the distilled
    distribution), the same final state as a plain extraction, and read back from the cache."""
    target, fs, layered = setup
    assert layered.layers == (0, 1) and layered.inputs.shape == (len(fs.tokens), 2 * target.hidden_size)
    assert torch.equal(layered.features, fs.features) and torch.equal(layered.tokens, fs.tokens)
    path = tmp_path / "f.safetensors"
    first = extract_features(target, [CorpusEntry("a", [5, 6, 7], [8, 9])], path, layers=(0, 1))
    counted = []
    cached = extract_features(target, [], path, layers=(0, 1), progress=counted.append)  # read back, not recomputed
    assert counted == [1]  # a cached file still reports its sequences to the progress bar
    assert cached.layers == (0, 1) and torch.equal(cached.inputs, first.inputs) and cached.inputs.shape == (5, 64)
    emb = target.embed_tokens(fs.tokens[:5])  # layer 0's input is the token embedding
    assert torch.allclose(layered.inputs[:5, : target.hidden_size].float(), emb.float(), atol=1e-2)


def test_feature_sets_of_two_files_join_into_the_set_of_both(setup, tmp_path):
    """A corpus cached per data file is joined into the features one extraction of it all gives."""
    target, _, _ = setup
    rng = random.Random(1)
    corpus = [CorpusEntry(str(i), [rng.randrange(2, 96) for _ in range(3 + i)], [rng.randrange(2, 96) for _ in range(4)])
              for i in range(5)]
    whole = extract_features(target, corpus, tmp_path / "all.safetensors", layers=(0, 1))
    parts = [extract_features(target, corpus[:2], tmp_path / "a.safetensors", layers=(0, 1)),
             extract_features(target, corpus[2:], tmp_path / "b.safetensors", layers=(0, 1))]
    first_rows = parts[0].features
    joined = concat_features(parts)
    assert parts == []  # taken out of the list
    assert len(joined) == 5 and joined.layers == (0, 1)
    for name in ("tokens", "starts", "prompt_lens"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    assert joined.features.shape == whole.features.shape and joined.inputs.shape == whole.inputs.shape
    assert torch.allclose(joined.features[:].float(), whole.features.float(), atol=1e-2)
    assert torch.allclose(joined.inputs[:].float(), whole.inputs.float(), atol=1e-2)
    for s in range(5):
        toks, feats, plen = joined.sequence(s)
        assert torch.equal(toks, whole.sequence(s)[0]) and plen == whole.sequence(s)[2]
        assert torch.allclose(feats.float(), whole.sequence(s)[1].float(), atol=1e-2)
        assert torch.allclose(joined.layer_inputs(s).float(), whole.layer_inputs(s).float(), atol=1e-2)
    # the parts are read in place, not copied into a joined tensor
    assert joined.sequence(0)[1].data_ptr() == first_rows.data_ptr()


def test_rows_read_several_tensors_as_one():
    """`Rows` slices like the joined tensor: views within a part, copies across parts, empty ends."""
    parts = [torch.arange(6.0).reshape(3, 2), torch.arange(6.0, 8.0).reshape(1, 2), torch.arange(8.0, 14.0).reshape(3, 2)]
    rows, whole = Rows(parts), torch.cat(parts)
    assert rows.shape == whole.shape and rows.dtype == whole.dtype and len(rows) == 7
    for a in range(8):
        for b in range(a, 8):
            assert torch.equal(rows[a:b], whole[a:b]), (a, b)
    assert torch.equal(rows[:], whole) and torch.equal(rows[-2:], whole[-2:])
    assert rows[4:6].data_ptr() == parts[2][0:2].data_ptr()  # within a part: a view
    with pytest.raises(ValueError, match="widths or dtypes"):
        Rows([torch.zeros(2, 2), torch.zeros(2, 3)])
    with pytest.raises(IndexError, match="contiguous"):
        rows[::2]


def test_features_too_big_for_the_disk_stay_in_memory(setup, tmp_path, monkeypatch, capsys):
    """Features that would leave the cache's disk nearly full are returned but not written, with
    a line saying so; the next run computes them again."""
    import shutil
    from collections import namedtuple

    from specula.training import features

    target, _, _ = setup
    corpus = [CorpusEntry(str(i), [2 + i, 3, 4], [5, 6]) for i in range(3)]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, features.KEEP_FREE_BYTES + 100))
    fs = extract_features(target, corpus, tmp_path / "f.safetensors", layers=(0, 1))
    assert len(fs) == 3 and fs.inputs.shape == (15, 2 * target.hidden_size)
    assert not (tmp_path / "f.safetensors").exists()
    assert "not cached" in capsys.readouterr().err
    monkeypatch.undo()
    again = extract_features(target, corpus, tmp_path / "f.safetensors", layers=(0, 1))
    assert (tmp_path / "f.safetensors").is_file() and torch.equal(again.tokens, fs.tokens)


@pytest.mark.parametrize("n", [3, 4, 17, 18, 19, 40, 41])
def test_chunks_cover_every_pair_once_and_end_at_the_answer(n):
    fs = FeatureSet(torch.zeros(n + 5, dtype=torch.long), torch.zeros((n + 5, 2)), torch.tensor([0, 5, n + 5]),
                    torch.tensor([1, n - 2]))
    pieces = chunks(fs, [0, 1], seq_len=8)
    pairs = [(a + i, a + i + 1) for s, a, rows in pieces if s == 1 for i in range(rows - 1)]
    every = [(i, i + 1) for i in range(n - 1)]
    assert sorted(pairs) == every[len(every) - len(pairs):]  # each pair of sequence 1 once, the last ones
    assert len(pairs) >= n - 2  # at most the first pair is left out (a one-pair piece teaches nothing)
    mine = [(a, rows) for s, a, rows in pieces if s == 1]
    assert all(3 <= rows <= 9 for _, rows in mine)
    assert mine[-1][0] + mine[-1][1] == n and mine[-1][1] == min(n, 9)  # the last piece ends at the end, full
    assert [a for a, _ in mine] == sorted(a for a, _ in mine)


@pytest.mark.parametrize("kind,topk_loss", [("eagle", 0.0), ("eagle3", 0.0), ("eagle3", 1.0), ("medusa", 0.0),
                                             ("hydra", 1.0)])
def test_a_training_step_lowers_the_loss(setup, kind, topk_loss):
    target, plain, layered = setup
    fs = layered if kind == "eagle3" else plain
    head = new_head(kind, target, draft_vocabulary(fs, 48, 96), seed=0)
    cfg = loss_config(TrainConfig(kind=kind, seq_len=32, noise=0.0, topk_loss=topk_loss))
    b = batch(fs, chunks(fs, list(range(4)), 32)[:4], head.embed)
    module = head.module.train().requires_grad_(True)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    before = loss_of(head, b, cfg, None).item()
    if topk_loss:  # the top-k term is in the loss the trainer steps on
        assert before > loss_of(head, b, loss_config(TrainConfig(kind=kind, seq_len=32, noise=0.0)), None).item()
    for _ in range(3):
        loss = loss_of(head, b, cfg, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss_of(head, b, cfg, None).item() < before


def test_the_top_k_term_reads_only_the_targets_likeliest_tokens():
    """HASS's top-k distillation: the cross-entropy over the k tokens p ranks highest, added to
    the full one with its weight; all V tokens give the full cross-entropy back."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((2, 3, 6), generator=gen)  # [B, T, V]
    p = torch.softmax(3 * torch.randn((2, 3, 6), generator=gen), -1)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    logq = torch.log_softmax(logits, -1)
    rows = [(b, t) for b in range(2) for t in range(3) if mask[b, t]]
    by_hand = sum(-sum(p[b, t, x] * logq[b, t, x] for x in p[b, t].argsort(descending=True)[:2]) for b, t in rows)
    assert torch.allclose(topk_ce(logits, p, mask, 2), by_hand / len(rows))
    assert torch.allclose(topk_ce(logits, p, mask, 6), soft_ce(logits, p, mask))
    assert topk_ce(logits, p, mask, 2) < soft_ce(logits, p, mask)
    assert torch.equal(distill(logits, p, mask, LossConfig()), soft_ce(logits, p, mask))  # off by default
    assert torch.allclose(distill(logits, p, mask, LossConfig(topk=2, topk_weight=0.5)),
                          soft_ce(logits, p, mask) + 0.5 * by_hand / len(rows))
    cfg = loss_config(TrainConfig(topk_loss=1.0, topk_loss_k=4))
    assert (cfg.topk, cfg.topk_weight) == (4, 1.0)
    with pytest.raises(ConfigError, match="^topk_loss must be a finite number >= 0"):
        TrainConfig(topk_loss=-1.0)
    with pytest.raises(ConfigError, match="topk_loss_k must be >= 1"):
        TrainConfig(topk_loss_k=0)


def _train(target, fs, out: Path, cfg: TrainConfig, max_seconds=None):
    head = new_head(cfg.kind, target, draft_vocabulary(fs, 64, 96), seed=cfg.seed)
    record = train_head(head, fs, cfg, out, max_seconds=max_seconds)
    return head, record


@pytest.mark.parametrize("scale", [1.0, 25.0])
def test_the_copy_hints_weights_learn_at_their_own_rate(setup, tmp_path, scale):
    """`copy_lr_scale` sets the copy hints' learning rate over `lr`, the rest of the head keeps `lr`:
    AdamW's first step moves a weight by its group's rate (sign of the gradient), so after one step
    the largest move of the hint's vectors (`copy_gain`, `copy_len`) is `scale` times that of
    `wqkv` and of the hint's projection `copy_proj`."""
    target, _, layered = setup
    head = new_head("eagle3", target, draft_vocabulary(layered, 64, 96), seed=0, copy_ngram=3)
    before = {n: p.detach().clone() for n, p in head.module.named_parameters()}
    probe = TrainConfig(kind="eagle3", seq_len=16, batch_size=4, holdout=0.0)
    per_epoch, _ = step_counts(layered, probe)
    cfg = TrainConfig(kind="eagle3", seq_len=16, batch_size=4, holdout=0.0, lr=1e-3, warmup_steps=1,
                      copy_ngram=3, copy_lr_scale=scale, epochs=1 / per_epoch, precision="float32")
    assert train_head(head, layered, cfg, tmp_path / "c")["steps"] == 1
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in head.module.named_parameters()}
    assert moved["wqkv.weight"] == pytest.approx(1e-3, rel=0.05)
    assert moved["copy_proj.weight"] == pytest.approx(1e-3, rel=0.05)
    assert moved["copy_gain"] == pytest.approx(scale * 1e-3, rel=0.05)
    assert moved["copy_len"] == pytest.approx(scale * 1e-3, rel=0.05)
    with pytest.raises(ConfigError, match="^copy_lr_scale must be a finite number > 0"):
        TrainConfig(copy_lr_scale=0)


def test_a_copy_hint_checkpoint_of_before_the_gains_is_named_and_not_resumed(setup, tmp_path):
    """A checkpoint of a copy-hint head written before `copy_gain` (its weights lack the gain, its
    optimizer one parameter group) cannot resume into today's head: the run starts afresh and says so."""
    target, _, layered = setup
    cfg = TrainConfig(kind="eagle3", seq_len=16, batch_size=4, holdout=0.2, epochs=2, checkpoint_every=1,
                      copy_ngram=3, precision="float32")
    d2t = draft_vocabulary(layered, 64, 96)
    train_head(new_head("eagle3", target, d2t, seed=0, copy_ngram=3), layered, cfg, tmp_path / "c", max_seconds=0.0)
    ckpt = tmp_path / "c" / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False)
    del state["module"]["copy_gain"]
    groups = state["optimizer"]["param_groups"]
    groups[0]["params"] += groups.pop()["params"]
    torch.save(state, ckpt)
    notes = []
    rec = train_head(new_head("eagle3", target, d2t, seed=0, copy_ngram=3), layered, cfg, tmp_path / "c",
                     on_note=notes.append)
    assert "weights" in rec["checkpoint_ignored"] and "not resumed" in notes[0]
    assert rec["heldout_before"] is not None  # afresh


def test_length_groups_batch_like_lengths_and_see_every_piece_once_an_epoch():
    rng = random.Random(3)
    lengths = [rng.choice([20, 300, 1025]) + rng.randrange(5) for _ in range(8 * LENGTH_WINDOW * 3 + 5)]
    plain = batch_order(lengths, 8, 0, 0)
    grouped = batch_order(lengths, 8, 0, 0, length_groups=True)
    assert plain == torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()  # as before
    assert sorted(grouped) == list(range(len(lengths)))  # every piece once
    assert grouped == batch_order(lengths, 8, 0, 0, length_groups=True)  # the same epoch, the same order (resume)
    assert grouped != batch_order(lengths, 8, 0, 1, length_groups=True)

    def padded(order):  # rows a run pads its batches to
        return sum(8 * max(lengths[i] for i in order[at:at + 8]) for at in range(0, len(order), 8))
    assert padded(grouped) < 0.6 * padded(plain)
    assert grouped[-5:] == sorted(plain[-5:], key=lambda i: lengths[i])  # the short last window's batch stays last
    # batches are shuffled across the epoch, not left in ascending length
    firsts = [lengths[grouped[at]] for at in range(0, len(grouped) - 5, 8)]
    assert firsts != sorted(firsts)


@pytest.mark.parametrize("precision,length_groups", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_training_is_deterministic_and_resumes_to_the_same_weights(setup, tmp_path, precision, length_groups):
    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=3, seq_len=16, batch_size=3, checkpoint_every=2, holdout=0.2,
                      precision=precision, length_groups=length_groups)
    a, rec_a = _train(target, fs, tmp_path / "a", cfg)
    assert rec_a["autocast"] == (None if precision == "float32" else "bfloat16")
    b, rec_b = _train(target, fs, tmp_path / "b", cfg)
    assert rec_a["last_losses"] == rec_b["last_losses"]
    for name, t in a.module.state_dict().items():
        assert torch.equal(t, b.module.state_dict()[name]), name
    # interrupted after ~nothing (a time budget of 0 s stops after one step), then resumed
    _, partial = _train(target, fs, tmp_path / "c", cfg, max_seconds=0.0)
    assert partial["stopped_by_time_budget"] and partial["steps"] < rec_a["steps"]
    c, rec_c = _train(target, fs, tmp_path / "c", cfg)
    assert rec_c["steps"] == rec_a["steps"]
    for name, t in a.module.state_dict().items():
        assert torch.equal(t, c.module.state_dict()[name]), name
    other, _ = _train(target, fs, tmp_path / "d", TrainConfig(**{**cfg.__dict__, "seed": 1}))
    assert not torch.equal(other.module.fc.weight, a.module.fc.weight)


def test_a_resumed_run_reports_the_held_out_figures_from_before_it_began(setup, tmp_path):
    """Stopped and rerun, the report lost its "before" (measured only on a run's first step)."""
    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=2, seq_len=16, batch_size=3, checkpoint_every=2, holdout=0.2)
    _, whole = _train(target, fs, tmp_path / "a", cfg)
    _, partial = _train(target, fs, tmp_path / "b", cfg, max_seconds=0.0)
    assert partial["stopped_by_time_budget"]
    _, resumed = _train(target, fs, tmp_path / "b", cfg)
    assert whole["heldout_before"] is not None and resumed["heldout_before"] == whole["heldout_before"]


def test_training_that_diverges_stops_with_one_line_and_writes_no_head(setup, tmp_path):
    target, fs, _ = setup
    with pytest.raises(ConfigError, match="lr a finite number"):
        TrainConfig(kind="eagle", lr=float("inf"))
    cfg = TrainConfig(kind="eagle", epochs=2, seq_len=16, batch_size=3, lr=1e30, grad_clip=1e30)
    with pytest.raises(ConfigError, match="training diverged at step .*lower lr="):
        _train(target, fs, tmp_path / "a", cfg)


def test_nothing_left_to_train_on_is_refused(setup, tmp_path):
    """Every sequence held out, or left out as a repeat of a held-out prompt: a head of fresh weights
    was written and reported as trained (0 training sequences, exit 0)."""
    target = setup[0]
    prompt = [5, 9, 13, 20, 31, 40]
    answer = [7] * 20  # the answer does not matter: every line repeats one prompt
    fs = extract_features(target, [CorpusEntry(str(i), prompt, answer) for i in range(6)], tmp_path / "f.safetensors")
    cfg = TrainConfig(kind="eagle", epochs=1, seq_len=16, batch_size=3, holdout=0.1)
    with pytest.raises(ConfigError, match="nothing to train on: 6 answered sequences, 1 held out and 5 more left out"):
        _train(target, fs, tmp_path / "a", cfg)


def test_a_checkpoint_of_other_settings_is_named_and_not_resumed_and_an_older_one_resumes(setup, tmp_path):
    """Rerunning with another setting starts afresh and says which setting differs; a checkpoint
    written before an option existed (its config lacks the field, at its default) still resumes."""
    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=3, seq_len=16, batch_size=3, checkpoint_every=2, holdout=0.2,
                      precision="float32")
    full, rec_full = _train(target, fs, tmp_path / "full", cfg)
    _, partial = _train(target, fs, tmp_path / "c", cfg, max_seconds=0.0)
    assert partial["steps"] < rec_full["steps"] and partial["checkpoint_ignored"] is None
    ckpt = tmp_path / "c" / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False)
    del state["config"]["topk_loss"], state["config"]["topk_loss_k"]  # as written before --topk-loss existed
    torch.save(state, ckpt)
    notes = []
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=cfg.seed)
    rec = train_head(head, fs, cfg, tmp_path / "c", on_note=notes.append)
    assert notes == [] and rec["checkpoint_ignored"] is None and rec["steps"] == rec_full["steps"]  # resumed
    assert rec["heldout_before"] == rec_full["heldout_before"]  # as measured when the run began
    assert torch.equal(head.module.fc.weight, full.module.fc.weight)
    other = TrainConfig(**{**cfg.__dict__, "lr": 5e-4})
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=cfg.seed)
    rec = train_head(head, fs, other, tmp_path / "c", on_note=notes.append)
    assert rec["checkpoint_ignored"] == {"lr": [cfg.lr, 5e-4]} and rec["heldout_before"] is not None  # afresh
    assert len(notes) == 1 and "lr 0.001 -> 0.0005" in notes[0] and "not resumed" in notes[0]
    assert notes[0].endswith("replaces it (pass another out= to keep it)"), notes  # the keyword, not --out
    assert torch.load(ckpt, weights_only=False)["config"]["lr"] == 5e-4  # replaced by this run's
    # a head of another draft vocabulary never takes the checkpoint either
    head = new_head("eagle", target, draft_vocabulary(fs, 32, 96), seed=cfg.seed)
    rec = train_head(head, fs, other, tmp_path / "c", on_note=notes.append)
    assert set(rec["checkpoint_ignored"]) == {"draft_vocab"} and "another vocabulary" in notes[-1]
    # nor a run on another target's features of the same tokens (a base against an instruct model, ...)
    from dataclasses import replace as with_fields

    theirs = with_fields(fs, features=fs.features * 1.5)
    head = new_head("eagle", target, draft_vocabulary(fs, 32, 96), seed=cfg.seed)
    rec = train_head(head, theirs, other, tmp_path / "c", on_note=notes.append)
    assert set(rec["checkpoint_ignored"]) == {"features"} and "another target's" in notes[-1]
    # nor a run on other data (the same settings and vocabulary)
    twice = concat_features([fs, fs])
    head = new_head("eagle", target, draft_vocabulary(fs, 32, 96), seed=cfg.seed)
    rec = train_head(head, twice, other, tmp_path / "c", on_note=notes.append)
    assert "data" in rec["checkpoint_ignored"] and "other prompts or answers" in notes[-1]


def test_a_run_from_another_starting_head_does_not_resume_the_checkpoint(setup, tmp_path):
    """Rerunning a stopped command with --init-head resumed the fresh run's checkpoint silently (the
    starting head's weights never used, while the report named it)."""
    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=3, seq_len=16, batch_size=3, checkpoint_every=2, holdout=0.2,
                      precision="float32")
    _, partial = _train(target, fs, tmp_path / "c", cfg, max_seconds=0.0)
    notes = []
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=cfg.seed)
    rec = train_head(head, fs, cfg, tmp_path / "c", on_note=notes.append, init="ab" * 32)
    assert set(rec["checkpoint_ignored"]) == {"init_head"} and "init_head fresh weights -> abab" in notes[0]
    _, again = _train(target, fs, tmp_path / "d", cfg, max_seconds=0.0)
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=cfg.seed)
    assert train_head(head, fs, cfg, tmp_path / "d", init=None)["checkpoint_ignored"] is None  # the same start


def test_max_seconds_counts_this_runs_training_not_the_resumed_checkpoints(setup, tmp_path, monkeypatch):
    """--max-minutes M, rerun to go on: the limit read the checkpoint's earlier training time too,
    so every rerun trained one step."""
    import specula.training.trainer as trainer

    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=3, seq_len=16, batch_size=3, checkpoint_every=2, holdout=0.2,
                      precision="float32")
    _, partial = _train(target, fs, tmp_path / "c", cfg, max_seconds=0.0)
    ckpt = tmp_path / "c" / "checkpoint.pt"
    state = torch.load(ckpt, weights_only=False)
    state["seconds"] = 3600.0  # an hour trained before
    torch.save(state, ckpt)
    _, rec = _train(target, fs, tmp_path / "c", cfg, max_seconds=60.0)
    assert not rec["stopped_by_time_budget"] and rec["steps"] == rec["total_steps"] > partial["steps"] + 1
    assert rec["seconds"] >= 3600.0  # the record still counts the whole run's training


def test_the_held_out_walk_emits_no_token_past_the_answer_and_skips_the_prompts_root():
    """A fake medusa head whose drafts are set per root: the decode walk of a 10-token sequence
    (prompt x0 x1, answer x2..x9) commits x3..x5, x6, x7..x9: 7 tokens in 3 steps (the report said
    8: a bonus token past the answer's end); the root on the prompt's last token, whose first
    token comes from the prefill and is never drafted, is not a position (it read 0.75 at depth 1)."""
    from types import SimpleNamespace

    from specula.training.trainer import acceptance_report

    vocab, tokens = 32, torch.tensor([5, 6, 10, 11, 12, 13, 14, 15, 16, 17])
    n, width = len(tokens), 32 + 10
    features = torch.zeros(n, width, dtype=torch.float16)
    features[torch.arange(n), vocab + torch.arange(n)] = 1  # each position's one-hot
    fs = FeatureSet(tokens, features, torch.tensor([0, n]), torch.tensor([2]))
    pred = {d: {c: int(tokens[c + d + 1]) if c + d + 1 < n else 0 for c in range(n)} for d in range(1, 5)}
    pred[3][1] = pred[1][4] = pred[1][0] = 31  # root 1: a run of 2; root 4: 0; root 0 (the prompt's): 0

    class Heads(torch.nn.Module):
        def forward(self, f, offsets):
            k, pos = list(offsets)[0], f[..., vocab:].argmax(-1)  # [B, n]
            out = torch.zeros(*f.shape[:-1], 1, width)
            for b in range(f.shape[0]):
                for i in range(f.shape[1]):
                    out[b, i, 0, pred[k + 1][int(pos[b, i])]] = 1
            return out

    head = SimpleNamespace(kind="medusa", config=SimpleNamespace(num_offsets=4, copy_ngram=0), lm_rows=None,
                           d2t=torch.arange(vocab), dtype=torch.float32, module=Heads(),
                           logits=lambda x: x[..., :vocab])
    report = acceptance_report(head, fs, [0], TrainConfig(kind="medusa", seq_len=16, eval_depth=4),
                               lambda t: torch.zeros(*t.shape, width))
    assert report["mean_accepted_walk"] == pytest.approx(7 / 3, abs=1e-3)
    assert report["positions"] == 7 and report["accept_rate_by_depth"][0] == pytest.approx(6 / 7, abs=1e-3)


def test_bfloat16_autocast_trains_the_same_head_up_to_rounding(setup, tmp_path):
    """Autocast changes the products' rounding, not what is learned: the same losses to ~1%,
    other bits; float32 weights either way."""
    target, _, layered = setup
    cfg = TrainConfig(kind="eagle3", epochs=2, seq_len=16, batch_size=3, holdout=0.2, precision="float32")
    f32, rec32 = _train(target, layered, tmp_path / "f32", cfg)
    b16, rec16 = _train(target, layered, tmp_path / "b16", TrainConfig(**{**cfg.__dict__, "precision": "bfloat16"}))
    assert rec32["last_losses"] != rec16["last_losses"]
    assert rec16["last_losses"] == pytest.approx(rec32["last_losses"], rel=0.02)
    assert all(t.dtype == torch.float32 for t in b16.module.state_dict().values())


def test_precision_auto_is_bfloat16_on_cuda_or_a_cpu_with_bfloat16_units(monkeypatch):
    import specula.models.native.kernels as kernels
    from specula.training.trainer import autocast_dtype

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert autocast_dtype("auto", torch.device("cpu")) is torch.bfloat16
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2"}))
    assert autocast_dtype("auto", torch.device("cpu")) is None
    assert autocast_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert autocast_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert autocast_dtype("float32", torch.device("cuda")) is None
    with pytest.raises(ConfigError, match="precision must be one of auto, float32, bfloat16"):
        TrainConfig(precision="fp16")


def test_held_out_split_and_vocabulary(setup):
    _, fs, _ = setup
    train, held = split(fs, 0.2, 0)
    assert sorted(train + held) == list(range(len(fs))) and len(held) == 2
    small, held_small = split(fs, 0.2, 0, max_sequences=3)
    middle, _ = split(fs, 0.2, 0, max_sequences=5)
    assert held_small == held and len(small) == 3 and set(small) <= set(middle) <= set(train)  # nested subsets
    assert split(fs, 0.2, 0, max_sequences=50)[0] == train
    d2t = draft_vocabulary(fs, 20, 96, always=[1])
    assert len(d2t) == 20 and 1 in d2t.tolist() and d2t.tolist() == sorted(d2t.tolist())
    assert 0 < coverage(fs, d2t) < 1 and coverage(fs, torch.arange(96)) == 1.0


def test_a_prompt_held_out_is_not_trained_on_through_a_repeat():
    """Data files repeat prompts (and a greedy answer repeats with its prompt): a sequence whose
    prompt a held-out sequence has is left out of training, on every size of the training part."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 96) for _ in range(4)] for _ in range(10)]
    seqs = [p + [rng.randrange(2, 96) for _ in range(3)] for p in prompts + prompts[:6]]  # 6 prompts twice
    tokens = torch.tensor([t for q in seqs for t in q])
    starts = torch.tensor([0, *torch.tensor([len(q) for q in seqs]).cumsum(0).tolist()])
    fs = FeatureSet(tokens, torch.zeros(len(tokens), 4), starts, torch.tensor([4] * len(seqs)))
    key = lambda s: tuple(seqs[s][:4])  # noqa: E731
    for seed in range(5):
        train, held = split(fs, 0.3, seed)
        assert not {key(s) for s in train} & {key(s) for s in held} and len(held) == 5
        assert len(train) + len(held) + sum(key(s) in {key(h) for h in held} for s in range(len(seqs))
                                            if s not in held) == len(seqs)
        assert set(split(fs, 0.3, seed, max_sequences=3)[0]) <= set(train)
    assert split_tokens(fs, [1, 0]).tolist() == seqs[1] + seqs[0]


def test_an_extended_vocabulary_keeps_the_head_tokens_and_adds_the_most_frequent_others():
    tokens = torch.tensor([5] * 9 + [7] * 6 + [3] * 4 + [8] * 2 + [2])  # 5 > 7 > 3 > 8 > 2 by count
    fs = FeatureSet(tokens, torch.zeros(len(tokens), 4), torch.tensor([0, len(tokens)]), torch.tensor([1]))
    head = torch.tensor([2, 3])  # a rare token the head holds stays in
    assert extend_vocabulary(head, fs, 4, 16).tolist() == [2, 3, 5, 7]
    assert extend_vocabulary(head, fs, 2, 16) is head  # no larger: the head's own
    assert extend_vocabulary(head, fs, 1, 16) is head  # never shrunk
    assert extend_vocabulary(head, fs, 9, 16).tolist() == [2, 3, 5, 7, 8]  # only tokens the corpus holds
    assert extend_vocabulary(head, fs, 16, 16).tolist() == list(range(16))


def test_vocabulary_counts_from_another_corpus_rank_the_tokens_and_ties_go_to_the_lower_id():
    tokens = torch.tensor([5] * 9 + [7] * 6 + [3] * 4 + [8] * 2 + [2])
    fs = FeatureSet(tokens, torch.zeros(len(tokens), 4), torch.tensor([0, len(tokens)]), torch.tensor([1]))
    other = token_counts(torch.tensor([11] * 5 + [12] * 5 + [9] * 5 + [4] * 2 + [13]), 16)  # 9, 11, 12 tie
    assert other[11] == 5 and other.sum() == 18
    assert draft_vocabulary(fs, 3, 16, counts=other).tolist() == [9, 11, 12]
    assert draft_vocabulary(fs, 2, 16, counts=other).tolist() == [9, 11]  # the tie's lower ids
    assert draft_vocabulary(fs, 3, 16, always=[1], counts=other).tolist() == [1, 9, 11]
    head = torch.tensor([2, 11])
    assert extend_vocabulary(head, fs, 4, 16, counts=other).tolist() == [2, 9, 11, 12]
    assert extend_vocabulary(head, fs, 9, 16, counts=other).tolist() == [2, 4, 9, 11, 12, 13]  # what `other` holds
    assert extend_vocabulary(head, fs, 4, 16).tolist() == [2, 5, 7, 11]  # without counts: the feature set's
    ties = FeatureSet(torch.tensor([6, 4, 6, 4]), torch.zeros(4, 4), torch.tensor([0, 4]), torch.tensor([1]))
    assert draft_vocabulary(ties, 1, 16).tolist() == [4]


def test_vocab_from_ranks_a_new_heads_vocabulary_by_another_corpus(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """`--vocab-from FILE`: the draft vocabulary is the file's most frequent tokens (prompts and
    answers, EOS always in), not the training sequences'; the report names the file."""
    from specula.cli import main
    from specula.drafters.heads.file import read_head

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, model, data = saved_training_setup(tmp_path, tiny_tokenizer, layers=4, prompts=8, stride=7, words=6)
    ranked = list(range(40, 60))
    corpus = tmp_path / "other.jsonl"
    lines = [{"id": f"x{i}", "prompt_ids": ranked[i:10], "output_ids": ranked[10:] * (i + 1)} for i in range(3)]
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), "--max-new-tokens", "8",
                 "--quiet", "--eval-data", "none", "--draft-vocab", "21", "--intermediate-size", "24", "--epochs", "1",
                 "--vocab-from", str(corpus), "--out", str(tmp_path / "v")]) == 0
    d2t = read_head(tmp_path / "v" / "eagle3.safetensors").d2t.tolist()
    assert set(ranked) < set(d2t) and len(d2t) == 21  # the 20 ranked tokens and an EOS id
    report = json.loads((tmp_path / "v" / "report.json").read_text())
    assert report["vocab_from"]["files"] == [str(corpus)] and report["vocab_from"]["tokens"] == (10 + 9 + 8) + 10 * (1 + 2 + 3)
    # --epochs 0: that head written out untrained, its vocabulary extended by another corpus's tokens
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"id": "y", "prompt_ids": [61, 62], "output_ids": [63] * 5 + [64] * 3}) + "\n")
    assert main(["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), "--max-new-tokens", "8",
                 "--quiet", "--eval-data", "none", "--draft-vocab", "23", "--epochs", "0", "--init-head",
                 str(tmp_path / "v" / "eagle3.safetensors"), "--vocab-from", str(more), "--out", str(tmp_path / "w")]) == 0
    start, wide = read_head(tmp_path / "v" / "eagle3.safetensors"), read_head(tmp_path / "w" / "eagle3.safetensors")
    assert sorted(wide.d2t.tolist()) == sorted(d2t + [63, 64]) and wide.config.draft_vocab == 23
    assert all(torch.equal(wide.state[k], start.state[k]) for k in start.state)  # not trained
    assert json.loads((tmp_path / "w" / "report.json").read_text())["training"]["steps"] == 0
    common = ["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), "--quiet", "--out", str(tmp_path / "x")]
    for extra, message in ((["--vocab-from", str(tmp_path / "nowhere")], "--vocab-from "),
                           (["--epochs", "0"], "--epochs 0 writes out the --init-head head untrained")):
        capsys.readouterr()
        assert main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_not_resumed_is_noted_with_the_keyword_in_python_and_the_flag_on_the_command_line(
        tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """The note on a checkpoint of other settings told a `run_training` caller "another --out keeps it"; it names
    the keyword (out=) to `on_note` now, and `specula train` prints the flags (--out; a setting that differs, as
    its flag: --draft-vocab)."""
    from specula.cli import main
    from specula.models.loading import load_backend
    from specula.training.corpus import CorpusConfig
    from specula.training.run import run_training

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer)
    common = ["train", "--target", str(path), "--kind", "eagle", "--data", str(data), "--max-new-tokens", "8",
              "--quiet", "--eval-data", "none", "--epochs", "1", "--seq-len", "16", "--out", str(tmp_path / "h")]
    assert main([*common, "--draft-vocab", "64"]) == 0
    capsys.readouterr()
    assert main([*common, "--draft-vocab", "32"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "(--draft-vocab 64 tokens -> 32 tokens" in notes[0], notes
    assert notes[0].endswith("not resumed; training starts afresh and replaces it (pass another --out to keep it)")
    target, tokenizer = load_backend(str(path))
    heard = []
    run_training(target, tokenizer, str(path), tmp_path / "h", TrainConfig(kind="eagle", epochs=1, seq_len=16),
                 [data], CorpusConfig(max_new_tokens=8), quiet=True, eval_data=[], on_note=heard.append)
    assert len(heard) == 1 and "(draft_vocab 32 tokens -> " in heard[0], heard
    assert heard[0].endswith("(pass another out= to keep it)"), heard
    assert "note:" not in capsys.readouterr().err  # on_note heard it, nothing printed


def test_a_head_shape_the_target_cannot_have_is_refused_before_the_answers(tmp_path, monkeypatch, tiny_tokenizer,
                                                                          capsys):
    """--num-kv-heads must divide the head's query heads (the target's hidden size / 8 on the tiny model:
    4): refused naming the option and the values that fit once the target is known, before its answers."""
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer)
    assert main(["train", "--target", str(path), "--data", str(data), "--quiet", "--eval-data", "none",
                 "--num-kv-heads", "3", "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("error: --num-kv-heads 3 does not divide the head's 4 query heads (the target's hidden size 32 / "
                   "8); give one of 1, 2, 4 (or 0: one per query head)"), err
    assert not list((tmp_path / "cache" / "training").glob("corpus-*"))  # were made first, then the error
    from specula.models.loading import config_shape
    from specula.training.run import check_new_shape

    with pytest.raises(ConfigError, match="^num_kv_heads=3 does not divide the head's 4 query heads"):  # Python's
        check_new_shape(TrainConfig(kind="eagle", num_kv_heads=3), config_shape(str(path)))


def test_a_run_refused_after_the_target_loads_leaves_no_out_folder(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """--out is made by the run's first write: a run refused once the target is known, or after its
    answers (a time budget too short to train), leaves no folder behind; a folder that was there
    keeps what it held."""
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer)
    common = ["train", "--target", str(path), "--data", str(data), "--quiet", "--eval-data", "none",
              "--max-new-tokens", "8"]
    for extra, message in ((["--num-kv-heads", "3"], "--num-kv-heads 3 does not divide"),
                           (["--padded-rows", "4"], "padded batches run through a Hugging Face model"),
                           (["--time-budget", "0.001"], "--time-budget leaves")):
        assert main([*common, *extra, "--out", str(tmp_path / "new" / "h")]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "new").exists()  # was made (empty) before the checks
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main([*common, "--num-kv-heads", "3", "--out", str(kept)]) == 2
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]


def test_training_time_test_mask_shows_what_drafting_shows():
    """Step j, row i = a depth-j draft row over root pair i - j: it sees true pairs <= i - j and
    its ancestors at steps 1..j-1 (positions i - j + k), itself at step j."""
    t = 7
    for j in range(4):
        mask = ttt_mask(t, j)
        for i in range(j, t):
            seen = {(k, c) for k in range(j + 1) for c in range(t) if mask[i, k * t + c]}
            expected = {(0, c) for c in range(i - j + 1)} | {(k, i - j + k) for k in range(1, j + 1)}
            assert seen == expected, (j, i)


def test_train_command_writes_a_head_that_generate_uses(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, model, data = saved_training_setup(tmp_path, tiny_tokenizer, prompts=8, stride=7, words=6)
    other = tmp_path / "other.jsonl"  # the held-out report's prompts: another source than the training data
    other.write_text("".join(json.dumps({"prompt": f"w{i + 40} w{i + 3} w{i + 60}"}) + "\n" for i in range(3)))
    code = main(["train", "--target", str(path), "--kind", "eagle", "--data", str(data), "--out", str(tmp_path / "h"),
                 "--epochs", "2", "--draft-vocab", "64", "--max-new-tokens", "24", "--seq-len", "16", "--quiet",
                 "--eval-data", str(other)])
    out = capsys.readouterr().out
    assert code == 0 and "held-out greedy chain acceptance (other source: other.jsonl, 3 sequences)" in out
    report = json.loads((tmp_path / "h" / "report.json").read_text())
    assert report["corpus"]["sequences"] == 8 and report["training"]["steps"] > 0
    other_source = report["training"]["other_source"]
    assert other_source["sequences"] == 3 and other_source["after"]["positions"] > 0
    assert other_source["after"]["mean_accepted_walk"] >= 1.0
    # evaluation prompts that are also training prompts are refused: the figure would not be held out
    spaced = tmp_path / "spaced.jsonl"  # the same prompts with other spacing and case: no other source either
    spaced.write_text("".join(json.dumps({"prompt": " " + json.loads(line)["prompt"].upper() + " "}) + "\n"
                              for line in data.read_text().splitlines() if line.strip()))
    for eval_data in (data, spaced):
        code = main(["train", "--target", str(path), "--kind", "eagle", "--data", str(data), "--out",
                     str(tmp_path / "h2"), "--epochs", "1", "--draft-vocab", "64", "--max-new-tokens", "8", "--quiet",
                     "--eval-data", str(eval_data)])
        err = capsys.readouterr().err
        assert code == 2 and "also training prompts" in err and len(err.strip().splitlines()) == 1
    head = tmp_path / "h" / "eagle.safetensors"
    code = main(["generate", "--target", str(path), "--method", "eagle", "--head", str(head), "--prompt",
                 "w5 w9 w13", "--raw", "--max-new-tokens", "12", "--ignore-eos", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    ids = list(tiny_tokenizer.encode("w5 w9 w13"))
    assert payload["token_ids"] == reference_greedy(model, ids, 12)


def test_train_command_trains_an_eagle3_head_that_generate_uses(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """`--kind eagle3`: features of EAGLE-3's depths (on a 4-layer model: the inputs of layers 1, 2
    and 2 -> 1, 2), a head file that records them, and `--method eagle3` output = plain greedy."""
    from specula.cli import main
    from specula.drafters.heads.file import read_head

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, model, data = saved_training_setup(tmp_path, tiny_tokenizer, layers=4)
    code = main(["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), "--out", str(tmp_path / "h"),
                 "--epochs", "2", "--draft-vocab", "64", "--max-new-tokens", "16", "--seq-len", "16", "--quiet",
                 "--eval-data"])
    assert code == 0
    head = read_head(tmp_path / "h" / "eagle3.safetensors")
    assert head.config.kind == "eagle3" and head.config.feature_layers == (1, 2)
    assert any(p.name.endswith("-layers1_2.safetensors") for p in (tmp_path / "cache" / "training").iterdir())
    capsys.readouterr()
    code = main(["generate", "--target", str(path), "--method", "eagle3", "--head", str(tmp_path / "h" / "eagle3.safetensors"),
                 "--prompt", "w5 w9 w13", "--raw", "--max-new-tokens", "12", "--ignore-eos", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    assert payload["token_ids"] == reference_greedy(model, list(tiny_tokenizer.encode("w5 w9 w13")), 12)
    # one more data file: only its sequences are generated and extracted, the first file's caches are reused
    cache = tmp_path / "cache" / "training"
    before = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    more = tmp_path / "more.jsonl"
    more.write_text("".join(json.dumps({"prompt": f"w{i + 11} w{i + 30} w{i + 7} w{i + 50}"}) + "\n" for i in range(4)))
    code = main(["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), str(more),
                 "--out", str(tmp_path / "h2"), "--epochs", "1", "--draft-vocab", "64", "--max-new-tokens", "16",
                 "--seq-len", "16", "--quiet", "--eval-data", "none", "--intermediate-size", "24", "--num-kv-heads", "2"])
    assert code == 0
    narrow = read_head(tmp_path / "h2" / "eagle3.safetensors").config
    assert (narrow.intermediate_size, narrow.num_kv_heads) == (24, 2)
    after = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert all(after[name] == mtime for name, mtime in before.items())  # untouched
    new = set(after) - set(before)
    assert sorted(n.split("-")[0] for n in new) == ["corpus", "features", "weights"]  # the answers' weights stamp
    report = json.loads((tmp_path / "h2" / "report.json").read_text())
    assert report["corpus"]["sequences"] == 10 and report["prompts"] == 10
    assert report["training"]["other_source"]["sequences"] == 0  # --eval-data none: no other-source report


def test_a_renamed_prompt_file_reads_the_cached_answers_under_its_own_ids(setup, tmp_path, tiny_tokenizer):
    """The corpus cache is keyed by a file's bytes; the prompts' ids carry the file's name. A copy
    under another name gets the same answers, in order, with its own ids (the context-prompt
    script maps answers to prompts by id)."""
    from specula.training.corpus import CorpusConfig, generate_corpus, read_prompts

    target = setup[0]
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"w{i + 5} w{i + 9} w{i + 20}"}) + "\n" for i in range(4)))
    b = tmp_path / "b.jsonl"
    b.write_bytes(a.read_bytes())
    cache = tmp_path / "corpus.jsonl"
    config = CorpusConfig(max_new_tokens=5)
    first = generate_corpus(target, tiny_tokenizer, read_prompts([a]), cache, config)
    again = generate_corpus(target, tiny_tokenizer, read_prompts([b]), cache, config)
    assert [e.id for e in again] == [pid for pid, _ in read_prompts([b])] != [e.id for e in first]
    assert [e.output_ids for e in again] == [e.output_ids for e in first]
    with pytest.raises(ConfigError, match="holds 4 answers for 3 prompts"):
        generate_corpus(target, tiny_tokenizer, read_prompts([b])[:3], cache, config)


def _cached_answers(path, data, tokenizer, corpus=None) -> list[list[int]]:
    """The answers of the model saved at `path` to the prompts of `data` (6 new tokens each), through
    `specula train`'s answer cache (`cache_paths`), or made afresh into `corpus` when given."""
    from specula.models.loading import LoadConfig, load_backend
    from specula.training.corpus import CorpusConfig, generate_corpus, read_prompts
    from specula.training.run import cache_paths

    config = CorpusConfig(max_new_tokens=6)
    target, _ = load_backend(str(path), LoadConfig(), "target")
    corpus = corpus if corpus is not None else cache_paths(target, data, config)[0]
    return [e.output_ids for e in generate_corpus(target, tokenizer, read_prompts([data]), corpus, config)]


def test_another_model_saved_at_the_same_path_gets_its_own_answers_and_features(tmp_path, tiny_tokenizer):
    """The cache was keyed by the model's path: a model retrained or replaced in place reused the old
    model's answers and features (and the head trained on them was recorded as the new model's)."""
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer)
    first = _cached_answers(path, data, tiny_tokenizer)
    assert _cached_answers(path, data, tiny_tokenizer) == first  # the same weights: read back from the cache
    tiny_model("llama", seed=4, layers=2).save_pretrained(path)
    own = _cached_answers(path, data, tiny_tokenizer, tmp_path / "own.jsonl")
    assert own != first and _cached_answers(path, data, tiny_tokenizer) == own  # the new model's, not the cached


def test_a_fine_tune_that_kept_the_output_head_gets_its_own_answers(tmp_path, tiny_tokenizer):
    """The stamp was the output head's rows alone: a model fine-tuned in place on its inner layers (a LoRA
    merged back, the head untouched) read as the same weights and trained on the old model's answers."""
    path, model, data = saved_training_setup(tmp_path, tiny_tokenizer)
    first = _cached_answers(path, data, tiny_tokenizer)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1.0)
    model.save_pretrained(path)  # the output head and embeddings as they were
    own = _cached_answers(path, data, tiny_tokenizer, tmp_path / "own.jsonl")
    assert own != first and _cached_answers(path, data, tiny_tokenizer) == own


def test_a_cache_stamped_by_the_head_alone_is_kept_and_restamped(tmp_path, tiny_tokenizer):
    """A cache from before the stamp held the logits (the head's hash alone) is these weights' when the head
    agrees: its answers are read back, not made again, and the stamp gains the logits."""
    import json

    from specula.models.loading import LoadConfig, load_backend
    from specula.training.run import _forget_other_weights, weights_stamp

    path, _, _ = saved_training_setup(tmp_path, tiny_tokenizer)
    target, _ = load_backend(str(path), LoadConfig(), "target")
    ours = weights_stamp(target)
    stamp, kept = tmp_path / "weights-k.txt", tmp_path / "corpus-k.jsonl"
    kept.write_text("x\n")
    stamp.write_text(ours["rows"] + "\n")
    _forget_other_weights(target, stamp, ["corpus-k.jsonl*"])
    assert kept.exists() and json.loads(stamp.read_text()) == ours
    moved = dict(ours, logits=[v + 1.0 for v in ours["logits"]])  # another model's logits, the same head
    stamp.write_text(json.dumps(moved))
    _forget_other_weights(target, stamp, ["corpus-k.jsonl*"])
    assert not kept.exists() and json.loads(stamp.read_text()) == ours


def test_a_prompt_file_with_an_id_given_twice_is_refused_naming_both_lines(tmp_path):
    from specula.training.corpus import read_prompts

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": f"w{n}"}) + "\n" for n, i in enumerate(["a", "b", "a"])))
    with pytest.raises(ConfigError, match=r"p.jsonl:3: id 'a' is also the id of line 1"):
        read_prompts([data])
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"  # the same id in two files: fine
    one.write_text(json.dumps({"id": "a", "prompt": "w5"}) + "\n")
    two.write_text(json.dumps({"id": "a", "prompt": "w9"}) + "\n")
    assert read_prompts([one, two]) == [("one:a", "w5"), ("two:a", "w9")]


def test_a_composed_prompt_file_is_written_with_its_manifest_and_reads_back(tmp_path):
    from specula.training.corpus import read_prompts, write_prompt_file

    out = tmp_path / "made" / "t.jsonl"
    rows = [{"id": "t0", "prompt": "Übersetze: w5 w9", "source": "x:de"}, {"id": "t1", "prompt": "w7", "source": "x:fr"}]
    write_prompt_file(out, rows, {"file": out.name, "prompts": 2})
    assert read_prompts([out]) == [("t:t0", "Übersetze: w5 w9"), ("t:t1", "w7")]
    assert json.loads((tmp_path / "made" / "t.manifest.json").read_text()) == {"file": "t.jsonl", "prompts": 2}
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == rows


def test_init_head_fine_tunes_a_head_from_its_weights_and_vocabulary(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """`--init-head`: training starts from the file's weights (the held-out acceptance before the
    fine-tuning run is the first run's after, on the same split), keeps its draft vocabulary and
    shape, records where it started, and learns the context `--seq-len` gives (the drafting
    window); its output is plain greedy's. A head of another kind or width is refused in one line;
    a larger `--draft-vocab` widens its vocabulary."""
    from specula.cli import main
    from specula.drafters.heads.file import read_head
    from specula.models.install import sha256_file

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, model, data = saved_training_setup(tmp_path, tiny_tokenizer, layers=4, prompts=8, stride=7, words=6)
    common = ["--target", str(path), "--kind", "eagle3", "--data", str(data), "--max-new-tokens", "16", "--quiet",
              "--eval-data", "none", "--draft-vocab", "64", "--intermediate-size", "24"]
    assert main(["train", *common, "--out", str(tmp_path / "a"), "--epochs", "2", "--seq-len", "16"]) == 0
    first = tmp_path / "a" / "eagle3.safetensors"
    assert main(["train", *common, "--out", str(tmp_path / "b"), "--epochs", "1", "--seq-len", "16", "--lr", "1e-4",
                 "--init-head", str(first)]) == 0
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    b = json.loads((tmp_path / "b" / "report.json").read_text())
    assert b["training"]["heldout_before"] == a["training"]["heldout_after"]
    assert b["init_head"] == {"path": str(first), "sha256": sha256_file(first)}
    tuned, base = read_head(tmp_path / "b" / "eagle3.safetensors"), read_head(first)
    assert torch.equal(tuned.d2t, base.d2t) and tuned.config == base.config
    assert tuned.training["init_head"]["sha256"] == b["init_head"]["sha256"]
    assert any(not torch.equal(tuned.state[k], base.state[k]) for k in base.state)  # it trained
    # a longer context: the head's window follows --seq-len
    assert main(["train", *common, "--out", str(tmp_path / "c"), "--epochs", "1", "--seq-len", "32",
                 "--init-head", str(first)]) == 0
    assert read_head(tmp_path / "c" / "eagle3.safetensors").training["config"]["seq_len"] == 32
    capsys.readouterr()
    code = main(["generate", "--target", str(path), "--method", "eagle3", "--head", str(tmp_path / "c" / "eagle3.safetensors"),
                 "--prompt", "w5 w9 w13", "--raw", "--max-new-tokens", "12", "--ignore-eos", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference_greedy(model, list(tiny_tokenizer.encode("w5 w9 w13")), 12)
    for extra, message in ((["--kind", "eagle"], f"--init-head {str(first)!r} is an eagle3 head; train it with --kind "
                                                 "eagle3"),
                           (["--intermediate-size", "32"], "was trained with --intermediate-size 24, not 32: its "
                                                           "shape is kept when fine-tuning; drop --intermediate-size")):
        code = main(["train", *common, *extra, "--out", str(tmp_path / "d"), "--epochs", "1", "--init-head", str(first)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    import re

    from specula.training.run import check_init_head

    with pytest.raises(ConfigError, match=re.escape(f'init_head={str(first)!r} is an eagle3 head; train it with '
                                                    'kind="eagle3"')):  # a Python caller's keywords
        check_init_head(first, TrainConfig(kind="eagle"))
    code = main(["train", *common, "--out", str(tmp_path / "d"), "--init-head", "installed"])
    err = capsys.readouterr().err
    assert code == 2 and "no eagle3 head is installed" in err
    # a larger --draft-vocab widens the head's vocabulary: its tokens kept, no weight added; output unchanged
    # (by the training part's tokens: a head of 32 of them, widened to 48)
    narrow = [*common[:-4], "--draft-vocab", "32", "--intermediate-size", "24"]
    assert main(["train", *narrow, "--out", str(tmp_path / "n"), "--epochs", "1", "--seq-len", "16"]) == 0
    base = read_head(tmp_path / "n" / "eagle3.safetensors")
    wide = [*common[:-4], "--draft-vocab", "48", "--intermediate-size", "24"]
    assert main(["train", *wide, "--out", str(tmp_path / "e"), "--epochs", "1", "--seq-len", "16",
                 "--init-head", str(tmp_path / "n" / "eagle3.safetensors")]) == 0
    widened = read_head(tmp_path / "e" / "eagle3.safetensors")
    assert len(base.d2t) < len(widened.d2t) == widened.config.draft_vocab <= 48
    assert set(base.d2t.tolist()) < set(widened.d2t.tolist())
    assert {k: v.shape for k, v in widened.state.items()} == {k: v.shape for k, v in base.state.items()}
    assert json.loads((tmp_path / "e" / "report.json").read_text())["draft_vocab"] == len(widened.d2t)
    capsys.readouterr()
    code = main(["generate", "--target", str(path), "--method", "eagle3", "--head", str(tmp_path / "e" / "eagle3.safetensors"),
                 "--prompt", "w5 w9 w13", "--raw", "--max-new-tokens", "12", "--ignore-eos", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference_greedy(model, list(tiny_tokenizer.encode("w5 w9 w13")), 12)


def test_a_raised_prompt_limit_keeps_the_cache_key_of_files_it_does_not_cut(tiny_tokenizer):
    """`--max-prompt-tokens`: a file whose prompts fit under the default limit and the new one reads
    the default settings (same cached answers); a file with a prompt the default cuts gets its own."""
    from dataclasses import replace

    from specula.prompts import encode_prompt
    from specula.training.corpus import CorpusConfig
    from specula.training.run import file_corpus

    short = [("a", "w5 w9 w13"), ("b", "w7 w8")]
    long_text = " ".join(f"w{i % 90 + 2}" for i in range(40))
    default = CorpusConfig(max_new_tokens=8)
    cut = replace(default, max_prompt_tokens=len(encode_prompt(tiny_tokenizer, long_text)) - 1)  # cuts the long one
    raised = replace(default, max_prompt_tokens=4096)
    assert file_corpus(tiny_tokenizer, short, raised) == default
    assert file_corpus(tiny_tokenizer, short, default) == default
    assert file_corpus(tiny_tokenizer, short + [("c", long_text)], cut) == cut
    article = " ".join(f"w{i % 90 + 2}" for i in range(default.max_prompt_tokens + 10))  # the default cuts it
    assert file_corpus(tiny_tokenizer, short + [("d", article)], raised) == raised
    lowered = replace(default, max_prompt_tokens=2)  # cuts even the short prompts: its own answers
    assert file_corpus(tiny_tokenizer, short, lowered) == lowered


def test_fit_epochs_cuts_the_schedule_to_the_time_left_and_never_lengthens_it():
    from specula.training.trainer import fit_epochs

    assert fit_epochs(3.0, 100, 10.0, 10.0) == pytest.approx(0.95)  # 95 of 300 steps fit in 10 s
    assert fit_epochs(3.0, 100, 10.0, 1e6) == 3.0
    assert fit_epochs(3.0, 100, 10.0, -5.0) == 0.0 and fit_epochs(3.0, 100, 0.0, 10.0) == 0.0


def test_the_probe_restores_the_head_it_timed(setup):
    from specula.training.trainer import probe_steps_per_second

    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=3, seq_len=16, batch_size=3)
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    before = {k: v.clone() for k, v in head.module.state_dict().items()}
    assert probe_steps_per_second(head, fs, cfg, 0.5) > 0
    for name, t in head.module.state_dict().items():
        assert torch.equal(t, before[name]), name


def test_the_probe_times_steady_steps_not_the_first_ones(setup, monkeypatch):
    """A first step that sets things up (here a 0.6 s sleep) is paid once per run, so the probe's
    rate leaves it out: it reads well above the run's plain steps / seconds."""
    import time

    from specula.training import trainer

    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=50, seq_len=16, batch_size=3)
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    real, calls = trainer.loss_of, []

    def slow_first(*args):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.6)
        return real(*args)

    monkeypatch.setattr(trainer, "loss_of", slow_first)
    rate = trainer.probe_steps_per_second(head, fs, cfg, 1.5)
    naive = len(calls) / 1.5  # at most: the run took at least 1.5 s
    assert len(calls) > trainer.WARM_STEPS + 2 and rate > 1.2 * naive


def test_refit_total_fits_the_time_left_within_the_epochs_asked():
    from specula.training.trainer import refit_total

    assert refit_total(40, 10.0, 10.0, 1000) == 40 + 95  # 95 more steps fit in 10 s (5% margin)
    assert refit_total(40, 10.0, 1e6, 300) == 300  # never more than the epochs asked
    assert refit_total(40, 10.0, -3.0, 300) == 41  # out of time: the schedule ends at the next step


def test_a_time_bounded_run_refits_its_schedule_from_its_own_rate(setup, tmp_path):
    """A probe that misjudged the rate sized the schedule: with `until`, the run lengthens it when
    time is left (up to the epochs asked) and shortens it, ending its cosine, when none is."""
    import math
    import time
    from dataclasses import replace

    from specula.training.trainer import REFIT_EVERY, WARM_STEPS, step_counts

    target, fs, _ = setup
    per_epoch = step_counts(fs, TrainConfig(kind="eagle", seq_len=16, batch_size=3, holdout=0.0))[0]
    first = math.ceil((WARM_STEPS + REFIT_EVERY + 5) / per_epoch)  # long enough to reach a re-fit
    short = TrainConfig(kind="eagle", epochs=first, seq_len=16, batch_size=3, holdout=0.0)
    asked = step_counts(fs, replace(short, epochs=first + 3))[1]
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    totals = []
    rec = train_head(head, fs, short, tmp_path / "long", until=time.monotonic() + 600, most_steps=asked,
                     on_total=totals.append)
    assert step_counts(fs, short)[1] < asked
    assert rec["steps"] == rec["total_steps"] == asked and totals[-1] == asked and rec["refits"]
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    long = replace(short, epochs=first + 10)
    rec = train_head(head, fs, long, tmp_path / "short", until=time.monotonic())
    assert rec["steps"] == rec["total_steps"] == WARM_STEPS + REFIT_EVERY + 1 < step_counts(fs, long)[1]
    assert not rec["stopped_by_time_budget"]  # it ended its schedule, not cut it


def test_a_deadline_cuts_the_epochs_to_fit_or_refuses_to_start(setup, monkeypatch):
    import time

    import specula.training.trainer as trainer
    from specula.training.run import KEEP_SECONDS, _fit_to_deadline
    from specula.training.trainer import step_counts

    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=3, seq_len=16, batch_size=3, holdout=0.2)
    per_epoch, total = step_counts(fs, cfg)
    assert total >= 20  # so the refusal below is the 20-step floor, not the whole run
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    # a rate at which 2.5 of the 3 epochs fit in the 30 s left after what is kept back
    monkeypatch.setattr(trainer, "probe_steps_per_second", lambda *a: 2.5 * per_epoch / (0.95 * 30))
    fitted, record = _fit_to_deadline(head, fs, cfg, time.monotonic() + KEEP_SECONDS + 30, 0)
    assert 2.3 < fitted.epochs < 2.5 + 1e-9 and record["epochs_asked"] == 3 and record["epochs"] == fitted.epochs
    monkeypatch.setattr(trainer, "probe_steps_per_second", lambda *a: 1000.0)
    fitted, _ = _fit_to_deadline(head, fs, cfg, time.monotonic() + KEEP_SECONDS + 30, 0)
    assert fitted == cfg  # never more epochs than asked
    monkeypatch.setattr(trainer, "probe_steps_per_second", lambda *a: 0.1)
    with pytest.raises(ConfigError, match=r"^deadline= leaves .*running again with more time \(deadline=\)"):
        _fit_to_deadline(head, fs, cfg, time.monotonic() + KEEP_SECONDS + 30, 0)
    with pytest.raises(ConfigError, match="features, kept in memory by cache_features=False, are not"):
        _fit_to_deadline(head, fs, cfg, time.monotonic() + KEEP_SECONDS + 30, 0, features_cached=False)


def test_a_deadline_shrinks_the_held_out_reports_before_it_refuses_to_train(tmp_path, monkeypatch):
    """Reports over the whole held-out split would leave too little time to train (a 1.5B target's
    1,552 held-out sequences on a GPU lent for a fixed time): they read a seeded share of it instead,
    at most `REPORT_SHARE` of the time left, and the head is trained."""
    import time
    from dataclasses import replace

    import specula.training.run as run
    import specula.training.trainer as trainer
    from specula.training.run import KEEP_SECONDS, _fit_to_deadline

    model = tiny_model("llama", "eager", seed=3)
    target = NativeCausalLM(configure(NativeDecoder.from_hf(model), "onednn", "none", "sdpa"), "native",
                            eos_token_ids=[])
    rng = random.Random(1)
    corpus = [CorpusEntry(str(i), p, reference_greedy(model, p, 12))
              for i, p in enumerate([rng.randrange(2, 96) for _ in range(6)] for _ in range(60))]
    fs = extract_features(target, corpus, tmp_path / "f.safetensors")
    cfg = TrainConfig(kind="eagle", epochs=50, seq_len=16, batch_size=3, holdout=0.5)  # 30 held out
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    monkeypatch.setattr(run, "acceptance_report", lambda head, fs, seqs, *a: time.sleep(0.05 * len(seqs)))
    monkeypatch.setattr(trainer, "probe_steps_per_second", lambda *a: 15.0)
    # about 4 s left after timing 20 reported sequences: both reports over all 30 would take 3 s,
    # leaving 1 s (15 steps: too few); over 20 of them 2 s, leaving 2 s (30 steps)
    fitted, record = _fit_to_deadline(head, fs, cfg, time.monotonic() + KEEP_SECONDS + 5, 0)
    assert fitted.report_sequences == record["report_sequences"] == 20 and record["heldout_sequences"] == 30
    assert 20 <= round(fitted.epochs * trainer.step_counts(fs, cfg)[0]) <= 40
    # the reports read a draw of N of the held-out split; the training split is unchanged
    whole = train_head(new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0), fs,
                       replace(cfg, epochs=0.05), tmp_path / "whole")
    part = train_head(new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0), fs,
                      replace(cfg, epochs=0.05, report_sequences=4), tmp_path / "part")
    assert (whole["heldout_sequences"], part["heldout_sequences"]) == (30, 4)
    assert whole["train_sequences"] == part["train_sequences"] == 30


def test_train_command_with_a_time_budget_records_how_it_fit(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer, prompts=6, stride=7, words=6)
    args = ["train", "--target", str(path), "--kind", "eagle", "--data", str(data), "--epochs", "2",
            "--draft-vocab", "64", "--max-new-tokens", "16", "--seq-len", "16", "--quiet", "--eval-data", "none"]
    assert main([*args, "--out", str(tmp_path / "h0"), "--time-budget", "0"]) == 2
    assert "--time-budget must be > 0" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "h"), "--time-budget", "30"]) == 0
    assert "time budget: 2.0 of 2.0 epochs run (the probe's" in capsys.readouterr().out
    budget = json.loads((tmp_path / "h" / "report.json").read_text())["training"]["time_budget"]
    assert budget["epochs"] == 2.0 and budget["probe_steps_per_second"] > 0


def test_a_run_under_a_time_budget_resumes_its_own_checkpoint(setup, tmp_path):
    """The budget fits the epochs (and the held-out report's size) anew at each start; a checkpoint
    that differs from the new fit in those alone is the same run's, and it is resumed with its own
    schedule. One of other settings still starts afresh."""
    from dataclasses import replace

    from specula.training.run import budgeted_checkpoint

    target, fs, _ = setup
    cfg = TrainConfig(kind="eagle", epochs=2, seq_len=16, batch_size=3, holdout=0.2, checkpoint_every=2)
    first = replace(cfg, epochs=0.6, report_sequences=1)  # what the first start's budget fitted
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)
    assert budgeted_checkpoint(tmp_path / "h", cfg, head, fs) is None  # no checkpoint yet
    train_head(head, fs, first, tmp_path / "h")
    head = new_head("eagle", target, draft_vocabulary(fs, 64, 96), seed=0)  # the rerun's
    again = replace(cfg, epochs=0.9)  # this start's fit
    assert budgeted_checkpoint(tmp_path / "h", again, head, fs) == first
    assert budgeted_checkpoint(tmp_path / "h", first, head, fs) is None  # the same settings: resumed as they are
    assert budgeted_checkpoint(tmp_path / "h", replace(again, lr=cfg.lr / 2), head, fs) is None  # other settings
    assert budgeted_checkpoint(tmp_path / "h", replace(again, seed=1), head, fs) is None
    # other data or another vocabulary start afresh, so the fit is this start's, not the checkpoint's
    assert budgeted_checkpoint(tmp_path / "h", again, head, concat_features([fs, fs])) is None
    other = new_head("eagle", target, draft_vocabulary(fs, 32, 96), seed=0)
    assert budgeted_checkpoint(tmp_path / "h", again, other, fs) is None


def test_the_train_command_under_a_time_budget_resumes_its_own_run(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """Rerun after a stop, the same `specula train --time-budget` command fits other epochs than its
    first start did; it resumes the checkpoint with the first fit's schedule instead of starting afresh."""
    from dataclasses import replace

    import specula.training.run as run
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer, prompts=6, stride=7, words=6)
    args = ["train", "--target", str(path), "--kind", "eagle", "--data", str(data), "--epochs", "2",
            "--draft-vocab", "64", "--max-new-tokens", "16", "--seq-len", "16", "--quiet", "--eval-data", "none",
            "--out", str(tmp_path / "h"), "--time-budget", "30"]
    real, fits = run._fit_to_deadline, iter([1.0, 1.5])  # what each start's probe fits

    def fit(*a, **k):
        config, budget = real(*a, **k)
        epochs = next(fits)
        return replace(config, epochs=epochs), budget | {"epochs": epochs}

    monkeypatch.setattr(run, "_fit_to_deadline", fit)
    assert main(args) == 0
    first = json.loads((tmp_path / "h" / "report.json").read_text())["training"]
    capsys.readouterr()
    assert main(args) == 0
    out, err = capsys.readouterr()
    again = json.loads((tmp_path / "h" / "report.json").read_text())["training"]
    assert "not resumed" not in err and "resumed the run's checkpoint with the schedule of its first fit, 1.0" in out
    assert again["time_budget"]["resumed_epochs"] == 1.0 and again["config"]["epochs"] == 1.0
    assert again["checkpoint_ignored"] is None and again["first_losses"] == first["first_losses"]
    assert again["steps"] >= first["steps"]


def test_stop_after_answers_caches_them_and_the_same_command_goes_on(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    from specula.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULA_CACHE", str(cache))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer, prompts=6, stride=7, words=6)
    args = ["train", "--target", str(path), "--kind", "eagle3", "--data", str(data), "--epochs", "1",
            "--draft-vocab", "64", "--max-new-tokens", "16", "--seq-len", "16", "--quiet", "--eval-data", "none",
            "--out", str(tmp_path / "h")]
    assert main([*args, "--stop-after", "answers"]) == 0
    assert "stopped after the answers: 6 sequences" in capsys.readouterr().out
    report = json.loads((tmp_path / "h" / "report.json").read_text())
    assert report["stopped_after"] == "answers" and report["corpus"]["sequences"] == 6
    answers = list((cache / "training").glob("corpus-*.jsonl"))
    assert len(answers) == 1 and not list((cache / "training").glob("features-*"))
    assert not (tmp_path / "h" / "eagle3.safetensors").exists()
    written, stamp = answers[0].read_bytes(), answers[0].stat().st_mtime_ns
    assert main([*args, "--stop-after", "features", "--no-feature-cache"]) == 2  # nothing would be kept
    assert main([*args, "--no-feature-cache", "--out", str(tmp_path / "once")]) == 0  # trains, writes no features
    assert (tmp_path / "once" / "eagle3.safetensors").is_file() and not list((cache / "training").glob("features-*"))
    assert main([*args, "--stop-after", "features"]) == 0
    assert len(list((cache / "training").glob("features-*"))) == 1
    assert main(args) == 0  # goes on from the cached answers and features
    assert answers[0].read_bytes() == written and answers[0].stat().st_mtime_ns == stamp  # read, not rewritten
    report = json.loads((tmp_path / "h" / "report.json").read_text())
    assert "stopped_after" not in report and report["training"]["steps"] > 0
    assert (tmp_path / "h" / "eagle3.safetensors").is_file()


def test_the_weights_are_stamped_once_a_run_however_many_prompt_files(tmp_path, monkeypatch, tiny_tokenizer):
    """Each prompt file's cache checked the target's weights with a pass of its own, in the answers pass and
    again in the features pass (2N passes for N files): the run stamps them once and every file reads that."""
    import specula.training.run as run
    from specula.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULA_CACHE", str(cache))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer, prompts=6, stride=7, words=6)
    lines = data.read_text().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("".join(lines[:3]))
    second.write_text("".join(lines[3:]))
    stamps = []
    real = run.weights_stamp
    monkeypatch.setattr(run, "weights_stamp", lambda target: stamps.append(target) or real(target))
    assert main(["train", "--target", str(path), "--kind", "eagle3", "--data", str(first), str(second), "--epochs",
                 "1", "--draft-vocab", "64", "--max-new-tokens", "16", "--seq-len", "16", "--quiet", "--eval-data",
                 "none", "--out", str(tmp_path / "h"), "--stop-after", "features"]) == 0
    assert len(stamps) == 1
    assert len(list((cache / "training").glob("weights-*.txt"))) == 2  # each file's cache still stamped
    assert len(list((cache / "training").glob("features-*"))) == 2


def test_answers_of_another_model_train_the_target_on_that_text(tmp_path, monkeypatch, tiny_tokenizer, capsys):
    """`--answers`: the corpus files a model with the same tokenizer cached (here a 2-layer sibling)
    stand in for the target's answers: the target writes none, takes its features over that text
    (a features cache of its own, keyed by the answers each file took), and says where its answers
    came from."""
    from specula.cli import main
    from specula.training.corpus import load_corpus

    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECULA_CACHE", str(cache))
    small, _, data = saved_training_setup(tmp_path, tiny_tokenizer, layers=2, prompts=6, stride=7, words=6)
    target, _, _ = saved_training_setup(tmp_path, tiny_tokenizer, layers=4, prompts=6, stride=7, words=6)
    common = ["--kind", "eagle3", "--data", str(data), "--epochs", "1", "--draft-vocab", "64", "--max-new-tokens", "16",
              "--seq-len", "16", "--quiet", "--eval-data", "none"]
    assert main(["train", "--target", str(small), *common, "--out", str(tmp_path / "a"), "--stop-after", "answers"]) == 0
    given = tmp_path / "given"
    given.mkdir()
    (written,) = (cache / "training").glob("corpus-*.jsonl")
    written.rename(given / written.name)  # the answers carried to another machine
    capsys.readouterr()
    assert main(["train", "--target", str(target), *common, "--out", str(tmp_path / "b"), "--answers", str(given)]) == 0
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    small_answers = load_corpus(given / written.name)
    assert report["corpus"]["answer_tokens"] == sum(len(e.output_ids) for e in small_answers)
    assert report["corpus"]["answers_by"]["files"] == [str(given)]
    assert not list((cache / "training").glob("corpus-*"))  # the target answered nothing
    assert len(list((cache / "training").glob("features-*"))) == 1
    assert (tmp_path / "b" / "eagle3.safetensors").is_file()
    # a corpus file of other prompts added to --answers: this file's features are read, not remade
    (features,) = (cache / "training").glob("features-*")
    stamp = features.stat().st_mtime_ns
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": "y", "prompt_ids": [1, 2, 3], "output_ids": [4, 5]}) + "\n")
    assert main(["train", "--target", str(target), *common, "--out", str(tmp_path / "d"),
                 "--answers", str(given), str(other)]) == 0
    assert list((cache / "training").glob("features-*")) == [features] and features.stat().st_mtime_ns == stamp
    # other answers to the same prompts: features of their own
    lines = (given / written.name).read_text().splitlines()
    first = json.loads(lines[0])
    first["output_ids"][0] = (first["output_ids"][0] + 1) % 64
    (given / written.name).write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert main(["train", "--target", str(target), *common, "--out", str(tmp_path / "e"), "--answers", str(given)]) == 0
    assert len(list((cache / "training").glob("features-*"))) == 2
    # a prompt the files hold no answer to, and answers of another vocabulary: one-line errors, exit 2
    more = tmp_path / "more.jsonl"
    more.write_text(data.read_text() + json.dumps({"prompt": "w3 w4 w5"}) + "\n")
    capsys.readouterr()
    assert main(["train", "--target", str(target), *common, "--data", str(more), "--out", str(tmp_path / "c"),
                 "--answers", str(given)]) == 2
    assert "hold no answer to prompt" in capsys.readouterr().err
    alien = tmp_path / "alien.jsonl"
    alien.write_text(json.dumps({"id": "x", "prompt_ids": [1, 2], "output_ids": [10 ** 6]}) + "\n")
    assert main(["train", "--target", str(target), *common, "--out", str(tmp_path / "c"), "--answers", str(alien)]) == 2
    assert "another tokenizer" in capsys.readouterr().err
    assert main(["train", "--target", str(target), *common, "--out", str(tmp_path / "c"), "--answers", str(given),
                 "--stop-after", "answers"]) == 2


def test_damaged_training_files_are_one_line_errors_naming_the_fix(tmp_path):
    """Answers, corpus caches, features caches and prompt files that do not read (a bad line, a file
    not UTF-8, a file cut short) are ConfigErrors naming the file (and line), not tracebacks; a
    `.partial`'s damaged line is dropped and its answer made again."""
    from specula.errors import ConfigError
    from specula.training.corpus import complete_lines, load_corpus, read_answers, read_prompts
    from specula.training.features import extract_features

    good = json.dumps({"id": "a", "prompt_ids": [5, 6], "output_ids": [7]})
    for bad in ('{"id": "b", "prompt_ids": [5], "output_ids": null}', '{"id": "b", "prompt_ids": "5 6", "output_ids": [7]}',
                '{"id": "b", "prompt_ids": [5, [6]], "output_ids": [7]}', '[1, 2]'):
        answers = tmp_path / "corpus-x.jsonl"
        answers.write_text(good + "\n" + bad + "\n")
        with pytest.raises(ConfigError, match=r"corpus-x.jsonl:2: not a corpus line"):
            read_answers([answers], 96)
        with pytest.raises(ConfigError, match=r"corpus-x.jsonl:2: not a corpus line.*delete"):
            load_corpus(answers)
    answers.write_bytes(good.encode() + b"\n\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_answers([answers], 96)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match="prompts.jsonl: not UTF-8 text"):
        read_prompts([prompts])
    with pytest.raises(ConfigError, match="is not a file"):
        read_prompts([tmp_path])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="held-out data .*empty.jsonl holds no prompts.*with eval_data, one"):
        read_prompts([empty], training=False)  # not training
    with pytest.raises(ConfigError, match="training data .*empty.jsonl holds no prompts.*with data=, one"):
        read_prompts([empty])
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "w5 w6"}\n')
    with pytest.raises(ConfigError, match="empty.jsonl holds no prompts"):  # among others: named, not "the data"
        read_prompts([one, empty])
    # JSON holds U+2028, U+2029 and U+0085 raw (json.dumps(ensure_ascii=False) writes them so), and a
    # file may start with a byte-order mark: read as written (they were cut into lines that are not JSON)
    odd = tmp_path / "odd.jsonl"
    texts = ["one\u2028two", "three\u2029four", "five\u0085six"]
    odd.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\r\n"
                                                 for t in texts).encode())
    assert [text for _, text in read_prompts([odd])] == texts
    with pytest.raises(ConfigError, match="^draft_vocab must be at least 2"):  # before answers and features
        TrainConfig(kind="eagle", draft_vocab=1)
    partial = tmp_path / "corpus.jsonl.partial"
    partial.write_text(good + "\n" + "\0" * 20 + "\n" + good.replace('"a"', '"c"') + "\n" + good[:10])
    lines = complete_lines(partial, lambda line: line.startswith("{"))
    assert len(lines) == 2 and partial.read_text() == "".join(lines)  # rewritten without the damaged lines
    before = partial.stat().st_mtime_ns
    assert complete_lines(partial) == lines and partial.stat().st_mtime_ns == before  # nothing to drop: untouched
    features = tmp_path / "features.safetensors"
    features.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ConfigError, match="cached features .* do not read.*delete the file"):
        extract_features(None, [], features)


def test_what_the_target_config_decides_is_refused_before_the_target_loads(tmp_path, monkeypatch, tiny_tokenizer,
                                                                           capsys):
    """A new head's --num-kv-heads is checked against the target's config.json, and --padded-rows
    against --backend native, before the target loads (up to a minute for the 1.5B)."""
    import specula.models.loading as loading
    from specula.cli import main

    monkeypatch.setenv("SPECULA_CACHE", str(tmp_path / "cache"))
    path, _, data = saved_training_setup(tmp_path, tiny_tokenizer)
    monkeypatch.setattr(loading, "load_backend", lambda *a, **k: pytest.fail("the target loaded first"))
    common = ["train", "--target", str(path), "--data", str(data), "--quiet", "--eval-data", "none",
              "--out", str(tmp_path / "h")]
    for extra, message in ((["--num-kv-heads", "3"], "--num-kv-heads 3 does not divide the head's 4 query heads"),
                           (["--backend", "native", "--padded-rows", "4"], "padded batches run through")):
        capsys.readouterr()  # the setup's save bar
        assert main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert loading.config_shape(str(path)).hidden_size == 32


def test_a_training_options_error_names_its_flag(tmp_path, capsys):
    """TrainConfig names its fields as Python does (topk_loss_k must be >= 1); `specula train` said so too, where
    the user had written --topk-loss-k. Refused before anything loads (the target does not exist)."""
    from specula.cli import main

    for extra, message in ((["--topk-loss-k", "0"], "error: --topk-loss-k must be >= 1"),
                           (["--max-sequences", "-1"], "error: --max-sequences must be >= 0 (0 = all), got -1")):
        code = main(["train", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path / "h"), *extra])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "h").exists()


def test_a_training_error_names_the_keywords_in_python_and_the_flags_on_the_command_line(tmp_path, capsys):
    """TrainConfig, check_inputs and read_prompts named `specula train`'s flags (--epochs, --stop-after answers,
    --no-feature-cache, --data) to a Python caller, who had written epochs=, stop_after="answers",
    cache_features=False, data=; they name the keywords now, and the command shows its flags for them. Refused
    before anything loads (the target does not exist)."""
    from specula.cli import main
    from specula.training.run import check_inputs

    data, empty, missing = tmp_path / "p.jsonl", tmp_path / "empty.jsonl", tmp_path / "nowhere"
    data.write_text('{"prompt": "w5 w6 w7"}\n')
    empty.write_text("")
    cases = [
        (lambda: TrainConfig(epochs=-1),
         "epochs=-1, lr=0.001: epochs must be a finite number >= 0 and lr a finite number > 0",
         ["--epochs", "-1"],
         "--epochs -1.0, --lr 0.001: epochs must be a finite number >= 0 and lr a finite number > 0"),
        (lambda: TrainConfig(kind="medusa", copy_ngram=2),
         'copy_ngram shapes an eagle / eagle3 head\'s decoder layer; a medusa head has none: drop it (or train '
         'kind="eagle3")',
         ["--kind", "medusa", "--copy-ngram", "2"],
         "--copy-ngram shapes an eagle / eagle3 head's decoder layer; a medusa head has none: drop it (or train "
         "--kind eagle3)"),
        (lambda: check_inputs(TrainConfig(), [data], [], stop_after="answers", answers=[data]),
         'stop_after="answers" makes the target\'s answers; with answers= there are none to make',
         ["--stop-after", "answers", "--answers", str(data)],
         "--stop-after answers makes the target's answers; with --answers there are none to make"),
        (lambda: check_inputs(TrainConfig(), [data], [], stop_after="features", cache_features=False),
         'stop_after="features" caches the features; cache_features=False keeps them in memory only',
         ["--stop-after", "features", "--no-feature-cache"],
         "--stop-after features caches the features; --no-feature-cache keeps them in memory only"),
        (lambda: check_inputs(TrainConfig(epochs=0), [data], []),
         "epochs=0 writes out the init_head head untrained; give init_head (or epochs > 0)",
         ["--epochs", "0"], "--epochs 0 writes out the --init-head head untrained; give --init-head (or epochs > 0)"),
        (lambda: check_inputs(TrainConfig(), [data], [], vocab_from=[missing]),
         f"vocab_from={str(missing)!r}: no such file or folder",
         ["--vocab-from", str(missing)], f"--vocab-from {str(missing)!r}: no such file or folder"),
        (lambda: check_inputs(TrainConfig(), [missing], []),
         f"training data {missing} does not exist: pass JSONL prompt files with data=",
         ["--data", str(missing)], f"training data {missing} does not exist: pass JSONL prompt files with --data"),
        (lambda: check_inputs(TrainConfig(), [data], [empty]),
         f"held-out data {empty} holds no prompts: pass JSONL prompt files with eval_data, one",
         ["--eval-data", str(empty)], f"held-out data {empty} holds no prompts: pass JSONL prompt files with "
                                      "--eval-data, one"),
    ]
    for call, python, argv, flags in cases:
        with pytest.raises(ConfigError) as caught:
            call()
        assert str(caught.value).startswith(python) and "--" not in str(caught.value), caught.value
        given = {"--data": [], "--eval-data": ["none"]}  # each given unless the case gives its own
        argv = [*argv, *(a for flag, value in given.items() if flag not in argv
                         for a in [flag, *(value or [str(data)])])]
        code = main(["train", "--target", str(tmp_path / "model"), "--out", str(tmp_path / "h"), "--quiet", *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"error: {flags}") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "h").exists()
