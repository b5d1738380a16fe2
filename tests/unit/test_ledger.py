"""The ledger's replay and its cross-check against the other members' record of each round."""

from __future__ import annotations

from pathlib import Path

from swarmnode.core.ledger import Ledger, check, cross_check, read_ledger

SURVIVOR, VICTIM = "aa" * 20, "bb" * 20


def cursor(position: int) -> dict[str, int]:
    return {"shard": 1, "epoch": 0, "position": position}


def into_round_one(tmp_path: Path) -> tuple[Ledger, Ledger]:
    """The survivor's and the victim's ledgers: round 0 averaged both, round 1's range is trained."""
    survivor, victim = Ledger(tmp_path / "s", SURVIVOR), Ledger(tmp_path / "v", VICTIM)
    for ledger in (survivor, victim):
        ledger.adopt(cursor(0), "fresh", 0)
        ledger.round(0, cursor(0), cursor(80))
        ledger.settle(0, "applied", 2, "d1", group=(SURVIVOR, VICTIM), included=(SURVIVOR, VICTIM))
        ledger.round(1, cursor(80), cursor(160))
    return survivor, victim


def two_rounds(tmp_path: Path, victim_adopts: int) -> dict[str, list[dict]]:
    """Round 0 averages both; in round 1 the victim dies before its parts arrive (the survivor's average
    leaves it out), then comes back at `victim_adopts`."""
    survivor, victim = into_round_one(tmp_path)
    survivor.settle(1, "applied", 2, "d2", group=(SURVIVOR, VICTIM), included=(SURVIVOR,))
    victim.adopt(cursor(victim_adopts), "peer", 2)  # the round-1 range is pending: the adopt settles it
    return {SURVIVOR: read_ledger(tmp_path / "s"), VICTIM: read_ledger(tmp_path / "v")}


def test_a_member_left_out_of_an_average_must_not_keep_that_round(tmp_path: Path) -> None:
    ledgers = two_rounds(tmp_path, victim_adopts=160)
    assert not check(ledgers[VICTIM]).errors  # alone, its chain replays: the cross-check is what sees it
    errors = cross_check(ledgers)
    assert len(errors) == 1 and "round 1" in errors[0] and VICTIM[:12] in errors[0], errors


def test_a_member_that_comes_back_at_the_rounds_start_trains_it_again(tmp_path: Path) -> None:
    ledgers = two_rounds(tmp_path, victim_adopts=80)
    assert cross_check(ledgers) == []
    report = check(ledgers[VICTIM])
    assert report.retrained == [((1, 0, 80), (1, 0, 160))]


def test_a_member_that_applied_another_model_does_not_testify(tmp_path: Path) -> None:
    """Round 1: the survivor reduced its part alone and applied it, while the victim, alive, never
    received that part (it gave the survivor up as silent) and applied the rest: their digests differ,
    so one of them is astray and will be repaired onto the other's lineage; the survivor's record is
    not the victim's model's. With the same digest it is."""
    survivor, victim = into_round_one(tmp_path)
    survivor.settle(1, "applied", 2, "d2-survivor", group=(SURVIVOR, VICTIM), included=(SURVIVOR,))
    victim.settle(1, "applied", 2, "d2-victim", group=(SURVIVOR, VICTIM), included=(SURVIVOR, VICTIM))
    ledgers = {SURVIVOR: read_ledger(tmp_path / "s"), VICTIM: read_ledger(tmp_path / "v")}
    assert cross_check(ledgers) == []
    same = {
        node: [{**e, "global_digest": "d2"} if e.get("outer_step") == 1 else e for e in entries]
        for node, entries in ledgers.items()
    }
    errors = cross_check(same)
    assert len(errors) == 1 and "round 1" in errors[0] and VICTIM[:12] in errors[0], errors


def test_a_carried_round_is_covered_again_by_the_next(tmp_path: Path) -> None:
    """A live member whose part came late carries its Δ: its round settles `carried` and the next
    round's range starts where its committed cursor stayed."""
    ledger = Ledger(tmp_path, VICTIM)
    ledger.adopt(cursor(0), "fresh", 0)
    ledger.round(0, cursor(0), cursor(80))
    ledger.settle(0, "carried", 2, "d1", group=(SURVIVOR, VICTIM), included=(SURVIVOR,))
    ledger.round(1, cursor(0), cursor(160))
    ledger.settle(1, "applied", 2, "d2", group=(SURVIVOR, VICTIM), included=(SURVIVOR, VICTIM))
    entries = read_ledger(tmp_path)
    report = check(entries)
    assert not report.errors and report.chain == [((1, 0, 0), (1, 0, 160))] and report.chain_steps == [1]
    assert cross_check({VICTIM: entries}) == []


def test_a_groups_settle_records_the_weight_each_member_offered(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "s", SURVIVOR)
    ledger.round(0, cursor(0), cursor(80))
    weights = {SURVIVOR: 2560.0, VICTIM: 1280.0, "ff" * 20: 9.0}  # (a weight of no member: not kept)
    ledger.settle(0, "applied", 2, "d1", group=(SURVIVOR, VICTIM), included=(SURVIVOR,), weights=weights)
    (_, settle) = read_ledger(tmp_path / "s")
    assert settle["weights"] == {SURVIVOR: 2560.0, VICTIM: 1280.0}
