"""Operator-level overlap: the pair length against brute force, and its bounds."""

import itertools
import random

import pytest

from opsched.overlap import COMM, COMPUTE, PassStreams, StreamOp, exact_pair_length, pair_length, piecewise_pair_length


def _brute_force(a, b):
    """The two-job shop optimum by enumerating, per stream, every interleaving of the chains' operations."""
    ops = [("a", k, op) for k, op in enumerate(a)] + [("b", k, op) for k, op in enumerate(b)]
    streams = [COMPUTE, COMM]
    on = {s: [o for o in ops if o[2].streams & s] for s in streams}
    best = float("inf")

    def interleavings(items):
        xa = [o for o in items if o[0] == "a"]
        xb = [o for o in items if o[0] == "b"]
        for pos in itertools.combinations(range(len(items)), len(xa)):
            seq, ia, ib = [], iter(xa), iter(xb)
            for k in range(len(items)):
                seq.append(next(ia) if k in pos else next(ib))
            yield seq

    for seqs in itertools.product(*(list(interleavings(on[s])) for s in streams)):
        preds = {(o[0], o[1]): set() for o in ops}
        for job, chain in (("a", a), ("b", b)):
            for k in range(1, len(chain)):
                preds[(job, k)].add((job, k - 1))
        for seq in seqs:
            for x, y in zip(seq, seq[1:]):
                preds[(y[0], y[1])].add((x[0], x[1]))
        length = {(o[0], o[1]): o[2].seconds for o in ops}
        end: dict = {}
        pending = set(preds)
        while pending:  # longest path; a cycle leaves nodes pending forever
            ready = [v for v in pending if preds[v] <= end.keys()]
            if not ready:
                break
            for v in ready:
                end[v] = max((end[u] for u in preds[v]), default=0.0) + length[v]
                pending.discard(v)
        if not pending:
            best = min(best, max(end.values(), default=0.0))
    return best


def _random_chain(rng, n):
    return tuple(StreamOp(rng.choice([COMPUTE, COMM]), float(rng.randint(1, 6))) for _ in range(n))


@pytest.mark.parametrize("seed", range(40))
def test_pair_length_is_the_two_job_shop_optimum(seed):
    rng = random.Random(seed)
    a, b = _random_chain(rng, rng.randint(1, 4)), _random_chain(rng, rng.randint(1, 4))
    got = pair_length(a, b)
    assert got == pytest.approx(_brute_force(a, b))
    total_a, total_b = sum(op.seconds for op in a), sum(op.seconds for op in b)
    assert max(total_a, total_b) - 1e-9 <= got <= total_a + total_b + 1e-9


def test_pieces_are_achievable_and_never_shorter():
    rng = random.Random(7)
    for _ in range(30):
        a, b = _random_chain(rng, 9), _random_chain(rng, 7)
        exact = exact_pair_length(a, b)
        assert pair_length(a, b) == exact  # short chains are paired exactly
        for most in (1, 2, 3, 5):
            assert piecewise_pair_length(a, b, most) >= exact - 1e-9
        assert piecewise_pair_length(a, b, 1) <= sum(op.seconds for op in a + b) + 1e-9


def test_long_chains_stay_between_the_bounds():
    rng = random.Random(3)
    a, b = _random_chain(rng, 600), _random_chain(rng, 450)
    got = pair_length(a, b)
    total_a, total_b = sum(op.seconds for op in a), sum(op.seconds for op in b)
    assert max(total_a, total_b) <= got < total_a + total_b


def test_pass_streams_merge_in_pipeline_order():
    early = PassStreams(F=(StreamOp(COMPUTE, 1.0),), I=(StreamOp(COMM, 2.0),), W=(StreamOp(COMPUTE, 3.0),))
    late = PassStreams(F=(StreamOp(COMM, 4.0),), I=(StreamOp(COMPUTE, 5.0),), W=(StreamOp(COMPUTE, 6.0),))
    both = early.then(late)
    assert [op.seconds for op in both.F] == [1.0, 4.0]
    assert [op.seconds for op in both.I] == [5.0, 2.0]  # the later stage's backward runs first
    assert [op.seconds for op in both.chain("B")] == [5.0, 2.0, 6.0, 3.0]
    assert both.scaled(0.5).total("B") == pytest.approx(8.0)
