"""The data plane's pure rules (a2ad.planerules) on the cases of the bugs they fixed, and the
simulator's data-plane world (python -m a2ad.sim): clean over a fixed seed budget, every
data-plane mutation caught, a seed replayed exactly, the command line's last line and status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from a2ad import mutations, planerules as rules
from a2ad.sim import plane
from a2ad.sim.world import WORLDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANE_MUTATIONS = sorted(n for n, m in mutations.REGISTRY.items() if m.world == "plane")
CLEAN_SEEDS = 300
CATCH_BUDGET = 2000  # every mutation is caught within this many seeds


# --- the rules ---------------------------------------------------------------------------
def test_a_rank_that_published_and_left_between_the_two_reads_counts():
    # view {0, 1, 2}; 1 and 2 missing at the first read, both gone from the mask; at the second
    # look 2's flag is there (it published, finished and left): 2 counts, 1 is let go
    assert rules.all_left(0b111, 0b110, 0b010) == 0b101
    with mutations.enabled("wait_no_second_look_mask"):
        assert rules.all_left(0b111, 0b110, 0b010) == 0b001


def test_a_wait_that_finds_the_abort_word_completes_when_its_flags_came_meanwhile():
    assert rules.completes_after_give_up(0b111, 0) is True
    assert rules.completes_after_give_up(0b111, 0b100) is False
    assert rules.completes_after_give_up(0b011, 0b100) is True  # a rank outside the round is no concern
    with mutations.enabled("wait_no_second_look"):
        assert rules.completes_after_give_up(0b111, 0) is False


def test_a_combine_publishes_outputs_only_to_the_sources_it_received_and_void_to_the_others():
    # view {0, 1, 2}; the dispatch let 2 go (it left the mask before its tokens came)
    assert rules.combine_publish(0b111, 0b011) == (0b011, 0b100)
    assert rules.combine_publish(0b111, 0b111) == (0b111, 0)
    with mutations.enabled("void_flag_withheld"):
        assert rules.combine_publish(0b111, 0b011) == (0b011, 0)
    with mutations.enabled("publish_to_unreceived"):
        assert rules.combine_publish(0b111, 0b011) == (0b111, 0)


def test_a_combine_counts_neither_void_nor_disagreeing_targets():
    got, counted = rules.combine_counted(seen=0b1111, voided=0b0100, disagree=0b1000)
    assert (got, counted) == (0b1011, 0b0011)


@pytest.mark.parametrize("view_round, view, behind", [
    (7, None, True),  # past R + 1: went on without this rank whatever its view
    (6, 0b011, True),  # at R + 1 with rank 2 outside its view
    (6, 0b111, False),  # at R + 1 with rank 2 inside: it waits for rank 2's next dispatch
    (5, None, False),  # still at R: no news
])
def test_the_left_behind_check(view_round, view, behind):
    rnd, me = 5, 2
    assert rules.view_needed(rnd, view_round) == (view_round == rnd + 1)
    assert rules.went_on_without(rnd, me, view_round, view) is behind
    with mutations.enabled("left_behind_unchecked"):
        assert rules.went_on_without(rnd, me, view_round, view) is False


def test_a_rank_let_go_of_in_a_dispatch_leaves_the_view_published_before_the_restage():
    # published {0, 1, 2} at the round's start; the dispatch let 2 go: the row says {0, 1}
    assert rules.published_view(0b111, 0b111, 0b011) == 0b011
    # a rank outside the round (a caller's mask) is not taken out
    assert rules.published_view(0b111, 0b011, 0b001) == 0b101
    with mutations.enabled("view_not_narrowed"):
        assert rules.published_view(0b111, 0b111, 0b011) == 0b111


def test_only_a_degrade_combine_counts_a_flag_past_its_round_and_takes_nothing_from_it():
    assert rules.past_round_is_seen(degrade=True, combine=True) is True
    assert rules.past_round_is_seen(degrade=True, combine=False) is False
    assert rules.past_round_is_seen(degrade=False, combine=True) is False
    with mutations.enabled("void_flag_overruns_wait"):
        assert rules.past_round_is_seen(degrade=True, combine=True) is False
    assert rules.combine_counted(seen=0b111, voided=0, disagree=0, ahead=0b001) == (0b110, 0b110)


def test_the_lowest_rank_of_a_view_lets_replacements_in():
    assert rules.lets_in(1, 0b1110) is True
    assert rules.lets_in(2, 0b1110) is False


def test_replacements_let_in_at_the_same_round_do_not_wait_for_each_other():
    # ranks 0-3 in M(E); 2 and 3 let in at E, both still at FLAG_VAL below E; rank 1 lags
    assert rules.lagging(2, admit_view=0b1111, behind=0b1110, same_round=0b1100) == 0b0010
    assert rules.lagging(2, admit_view=0b1111, behind=0b1100, same_round=0b1100) == 0
    with mutations.enabled("admitted_together_wait"):
        assert rules.lagging(2, admit_view=0b1111, behind=0b1100, same_round=0b1100) == 0b1000


def test_the_candidates_of_the_left_behind_check_are_the_ranks_pulled_from_but_this_one():
    assert rules.left_behind_candidates(1, 0b1011) == 0b1001


def test_mutations_are_off_unless_enabled_and_unknown_names_are_refused():
    assert not mutations.enabled_names() or os.environ.get("A2AD_MUTATION")
    with mutations.enabled("void_flag_withheld"):
        assert mutations.active("void_flag_withheld")
        assert not mutations.active("publish_to_unreceived")
    assert not mutations.active("void_flag_withheld")
    with pytest.raises(KeyError):
        with mutations.enabled("no_such_bug"):
            pass


def test_the_rules_module_imports_nothing_of_the_daemon():
    code = ("import sys, a2ad.planerules; "
            "bad = [m for m in sys.modules if m.startswith(('a2ad.daemon', 'torch'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


# --- the plane world ----------------------------------------------------------------------
def test_the_plane_world_is_clean_over_its_seed_budget():
    faults = 0
    for seed in range(CLEAN_SEEDS):
        out = plane.run(seed, None)
        assert out.world == "plane" and out.seed == seed and out.steps > 0
        faults += out.faults
        assert not out.violations, (seed, out.violations, "\n".join(out.trace[-40:]))
    assert faults > CLEAN_SEEDS  # the budget injects faults (1.5 a seed on average)


@pytest.mark.parametrize("name", PLANE_MUTATIONS)
def test_every_plane_mutation_is_caught_within_its_budget(name):
    for seed in range(CATCH_BUDGET):
        out = plane.run(seed, name)
        if out.violations:
            print(f"{name}: caught at seed {seed}: {out.violations[0].invariant}")
            return
    pytest.fail(f"mutation {name} not caught in {CATCH_BUDGET} seeds")


def _first_caught(name: str, start: int = 0) -> int:
    for seed in range(start, start + CATCH_BUDGET):
        if plane.run(seed, name).violations:
            return seed
    pytest.fail(f"mutation {name} not caught in {CATCH_BUDGET} seeds from {start}")


def test_a_seed_replays_exactly():
    seed = _first_caught("publish_to_unreceived")
    a, b = plane.run(seed, "publish_to_unreceived"), plane.run(seed, "publish_to_unreceived")
    assert a.violations and a.trace == b.trace and a.steps == b.steps and a.violations == b.violations
    c = plane.run(seed + 1, "publish_to_unreceived")
    assert c.trace != a.trace
    assert "plane" in WORLDS


def _sim(*args):
    return subprocess.run([sys.executable, "-m", "a2ad.sim", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_the_command_line_says_how_many_schedules_faults_and_violations():
    ok = _sim("--seeds", "20", "--world", "plane")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    last = ok.stdout.strip().splitlines()[-1]
    assert last.startswith("sim: 20 schedules, ") and last.endswith(" 0 violations"), last
    name, start = "publish_to_unreceived", 5
    first = _first_caught(name, start)
    n = first - start + 10
    bad = _sim("--seeds", str(n), "--start", str(start), "--mutation", name)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    lines = bad.stdout.strip().splitlines()
    assert f"VIOLATION seed {first} world plane: " in bad.stdout
    assert f"mutation {name}: first caught after {first - start + 1} seeds (seed {first})" in lines
    assert lines[-1].startswith(f"sim: {n} schedules, ") and not lines[-1].endswith(" 0 violations")
    replay = _sim("--replay", str(first), "--mutation", name)
    assert replay.returncode == 1 and f"VIOLATION seed {first} world plane: " in replay.stdout
    out = plane.run(first, name)
    assert replay.stdout.strip().splitlines()[-1] == \
        f"sim: 1 schedules, {out.faults} faults, {len(out.violations)} violations"
    assert len(replay.stdout.splitlines()) > len(out.trace)  # the whole trace
    listed = _sim("--list-mutations")
    assert listed.returncode == 0
    assert {line.split()[0] for line in listed.stdout.splitlines()} >= set(PLANE_MUTATIONS)
