"""The planner's doubling pause (`planner.pause.Pause`): losses sit out 1, 2, 4, ... steps up to the
longest pause, a win halves the next pause, and a step is sat out only while the pause runs."""

from specula.planner.pause import Pause


def sat_out(pause: Pause, steps: int) -> int:
    return sum(pause.waiting() for _ in range(steps))


def test_losses_double_the_pause_up_to_the_longest():
    pause = Pause()
    assert not pause.waiting()  # no pause yet: the step drafts
    lengths = []
    for _ in range(6):
        pause.lose(longest=8)
        lengths.append(sat_out(pause, 100))
    assert lengths == [1, 2, 4, 8, 8, 8]


def test_a_win_halves_the_next_pause_and_never_below_one_step():
    pause = Pause()
    for _ in range(4):
        pause.lose(longest=64)
    sat_out(pause, 100)
    assert pause.next == 16
    pause.win()
    pause.win()
    pause.lose(longest=64)
    assert sat_out(pause, 100) == 4
    for _ in range(10):
        pause.win()
    assert pause.next == 1


def test_a_pause_can_start_with_steps_left():
    pause = Pause(left=1)  # e.g. a drafter found out on the request's last step: held at once
    assert pause.waiting() and not pause.waiting()


def test_sessions_stepped_together_on_a_backend_that_does_not_pack_are_charged_their_own_pass(monkeypatch):
    """The HF backend runs one pass a session: each session's step was charged every session's
    pass, so at 4 sessions drafting that always paid read 4x dearer and the back-off paused it
    (mean accepted 1.14 against 3.00 alone). A fake clock: a pass costs 10 ms, anything else 10 us."""
    from tiny import VOCAB, successor_model

    from specula.drafters import make_drafter
    from specula.engine import EngineConfig, SpeculativeDecoder
    from specula.models.hf import HFCausalLM
    from specula.planner import HardwarePlanner
    from specula.sampling import SamplingParams

    clock = [0.0]

    def tick() -> float:
        clock[0] += 1e-5
        return clock[0]

    monkeypatch.setattr("time.perf_counter", tick)
    target = HFCausalLM(successor_model(), "target")
    seq_type = type(target.new_sequence())
    real = seq_type.forward_tree

    def timed(self, *args, **kwargs):
        clock[0] += 0.01
        return real(self, *args, **kwargs)

    monkeypatch.setattr(seq_type, "forward_tree", timed)
    planner = HardwarePlanner(target)
    dec = SpeculativeDecoder(target, [make_drafter("prompt-lookup")], eos_token_ids=[], planner=planner,
                             config=EngineConfig(max_tree_nodes=2))
    prompt = list(range(VOCAB)) + list(range(20))  # prompt lookup finds every continuation
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    outs = dict(dec.generate_many([(i, prompt, params) for i in range(4)], max_batch_size=4))
    for out in outs.values():
        assert out.token_ids == [(20 + k) % VOCAB for k in range(60)]
        assert out.stats.mean_accepted_tokens > 2.5 and not out.stats.planner.get("paused_steps")
