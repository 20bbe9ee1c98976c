"""Admission (flowrl/runtime/admission.py) on its own: callbacks in random orders, no run, no sleeps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.runtime.admission import Admission
from flowrl.runtime.quota import Quota


def admission(batch: int, steps: int, budget: int | None, credited: bool,
              oversampling: tuple[float, float] | None = None) -> Admission:
    return Admission(batch, steps, budget, credited, Quota(batch, oversampling, refills=not credited))


def drain(a: Admission, version: int, ended: set[int] | None = None) -> list[tuple[int, int, bool]]:
    """Every sample that may be handed out at `version`, in order."""
    out = []
    while (issued := a.issue(version, ended or set())) is not None:
        out.append(issued)
    return out


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 5), steps=st.integers(1, 6), budget=st.integers(0, 3), version=st.integers(0, 7))
def test_with_no_losses_exactly_v_plus_budget_plus_one_steps_are_admitted(batch, steps, budget, version):
    a = admission(batch, steps, budget, credited=budget > 0)
    issued = drain(a, version)
    assert len(issued) == min((version + budget + 1) * batch, steps * batch)
    assert [(s, i) for s, i, _ in issued] == [(n // batch, n % batch) for n in range(len(issued))]
    assert not any(beyond for *_, beyond in issued)
    assert not a.may_issue(version) and not a.more_may_come(version)


events = st.lists(st.one_of(st.tuples(st.just("issue"), st.integers(0, 2)),  # the clock moves by 0..2
                            st.tuples(st.just("lose"), st.integers(0, 10**6)),
                            st.tuples(st.just("arrive"), st.integers(0, 10**6))), max_size=80)


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 4), steps=st.integers(1, 6), budget=st.integers(0, 3), credited=st.booleans(),
       order=events)
def test_random_event_orders_never_admit_beyond_the_formula_and_credit_only_losses(batch, steps, budget,
                                                                                   credited, order):
    credited = credited and budget > 0  # the plan's rule (flowrl/graph/facts.py)
    a = admission(batch, steps, budget, credited)
    version, out, lost, arrived = 0, [], set(), set()
    for event, n in order:
        if event == "issue":
            version += n
            before, credit = a.issued, a.credit
            may, more = a.may_issue(version), a.more_may_come(version)
            got = a.issue(version, set())
            assert (got is not None) == may == more  # no quota declared: the two questions agree
            if got is None:
                assert before >= min((version + budget + 1) * batch + credit, steps * batch)
                continue
            step, index, beyond = got
            assert step * batch + index == before < (version + budget + 1) * batch + credit
            assert before < steps * batch  # the run's limit: no credit without a declared quota
            assert beyond == (credited and before >= (version + budget + 1) * batch)
            out.append(f"{step}:{index}")
        elif out:
            sample = out[n % len(out)]
            if sample in lost | arrived:
                continue
            (lost if event == "lose" else arrived).add(sample)
            if event == "lose":
                a.lose(sample, arrived=False)
            else:
                a.arrived(int(sample.split(":")[0]))
        assert a.credit <= len(lost)
        assert a.credit == (len(lost) if credited else 0)
    assert len(out) == len(set(out))


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 4), steps=st.integers(1, 5), losses=st.integers(0, 30))
def test_every_lost_sample_admits_one_more_where_credited(batch, steps, losses):
    a = admission(batch, steps, 1, credited=True)
    first = drain(a, 0)
    assert len(first) == min(2, steps) * batch
    for i in range(losses):
        a.lose(f"x:{i}", arrived=False)
    again = drain(a, 0)
    assert len(again) == min(losses, steps * batch - len(first))
    assert all(beyond for *_, beyond in again)  # admitted by credit: counted as oversampled


def test_state_restores_what_it_took_and_is_a_copy():
    a = admission(2, 4, 1, credited=True)
    drain(a, 0)
    a.lose("0:1", arrived=False)
    state = a.state()
    drain(a, 1)
    a.lose("1:0", arrived=False)
    b = admission(2, 4, 1, credited=True)
    b.restore(state)
    assert b.cursor == [2, 0] and b.credit == 1 and a.cursor == [3, 1] and a.credit == 2
    assert b.issue(0, set()) == (2, 0, True)  # the credit admits one sample past version 0's
    assert b.issue(0, set()) is None


def test_over_sampling_starts_each_step_larger_and_caps_the_credit():
    # DAPO-style: 1.5 x batch per step, at most 2 x batch: credit <= (cap - per_step) per admitted step.
    a = admission(4, 10, 1, credited=True, oversampling=(1.5, 2.0))
    assert a.quota.per_step == 6 and a.quota.cap == 8
    assert len(drain(a, 0)) == 12
    for i in range(100):
        a.lose(f"l:{i}", arrived=False)
    assert a.credit == 100 and a.admitted(0) == 12 + 2 * 2
    assert len(drain(a, 0)) == 4
    assert a.limit() == 10 * 6 + 10 * 2


def test_a_sync_input_refills_a_lost_sample_of_the_same_step_first():
    a = admission(2, 3, 0, credited=False, oversampling=(1.0, 2.0))
    assert [(s, i) for s, i, _ in drain(a, 0)] == [(0, 0), (0, 1)]
    a.lose("0:1", arrived=False)
    a.arrived(0)
    assert a.issue(0, set()) == (0, 2, True)  # a replacement, past the step's batch_size
    assert a.issue(0, set()) is None  # step 0 is full again; step 1 waits for version 1
    assert not a.settle(0)  # the replacement is in flight
    a.arrived(0)
    assert a.settle(0)


def test_a_node_that_reaches_no_train_node_is_bounded_only_by_steps():
    a = admission(3, 2, None, credited=False)
    assert len(drain(a, 0)) == 6
    assert not a.more_may_come(0)
    with pytest.raises(TypeError):
        a.admitted(0)  # no budget: no formula
    assert math.isfinite(a.limit())
