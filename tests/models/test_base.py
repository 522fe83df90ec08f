"""The backend protocol's helpers (`specula.models.base`): `conforms` answers as `isinstance` does."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from specula.models.base import ArgmaxScreeningModel, BatchedTargetModel, FeatureModel, conforms


@runtime_checkable
class _Sized(Protocol):
    def size(self) -> int: ...

    @property
    def name(self) -> str: ...


class _Whole:
    name = "whole"

    def size(self) -> int:
        return 1


class _Lacking:
    def size(self) -> int:
        return 1


class _FromInstance:
    """Lacks `name` as a class; some of its instances get it."""

    def __init__(self, named: bool) -> None:
        if named:
            self.name = "given"

    def size(self) -> int:
        return 1


def test_conforms_answers_as_isinstance_for_every_class_and_instance():
    objects = [_Whole(), _Lacking(), _FromInstance(True), _FromInstance(False), _FromInstance(True), object(), 3]
    for protocol in (_Sized, ArgmaxScreeningModel, BatchedTargetModel, FeatureModel):
        for _ in range(2):  # the second round answers from the cache where it may
            assert [conforms(o, protocol) for o in objects] == [isinstance(o, protocol) for o in objects]
    assert [conforms(o, _Sized) for o in objects] == [True, False, True, False, True, False, False]
