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
