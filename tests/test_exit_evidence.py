"""No policy from too little evidence (acl_fairseq/early_exit/evidence.py): every calibration
and the deploy choice refuse a split too small for the kind, in one line naming the size
needed; a policy that ignores the row is deployed only with a warning."""

from __future__ import annotations

import math
import re

import pytest
import torch
from test_exit_calibration import random_exits

from acl_fairseq.early_exit.calibrate import calibrate, calibrated_family
from acl_fairseq.early_exit.evidence import (
    MIN_PER_CLASS,
    TooLittleEvidence,
    check_learned,
    check_split,
    degenerate,
)
from acl_fairseq.early_exit.learned import LearnedPolicy
from acl_fairseq.early_exit.learned_calibration import calibrate_learned, cross_fit
from acl_fairseq.early_exit.per_exit import per_exit_policy
from acl_fairseq.early_exit.policies import EntropyPolicy, MaxProbPolicy, PatiencePolicy
from acl_fairseq.early_exit.risk_control import risk_controlled_kind
from acl_fairseq.inference import deploy
from acl_fairseq.inference.saved_policy import read_policy

KINDS = ["entropy", "maxprob", "patience", "per_exit_entropy", "per_exit_maxprob", "learned"]


def rows_of(exits, labels, keep):
    return [(layer, x[keep]) for layer, x in exits], labels[keep]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 3])
def test_a_split_of_one_or_three_rows_is_refused_by_every_calibration(kind, n):
    """Before: 1 or 3 rows gave entropy:inf, per_exit_entropy:1=inf or a learned model whose
    every weight is 0 (every row at exit 1), and the sweep deployed it."""
    exits, labels = random_exits(n, [1, 2, 3], seed=1)
    expected = (
        rf"^valid has {n} rows? \(class 0: \d, class 1: \d\): choosing an early-exit policy "
        rf"needs at least {MIN_PER_CLASS} rows of each of the 2 classes: use a larger split "
        rf"\(at least {2 * MIN_PER_CLASS} rows, {MIN_PER_CLASS} of each class\)$"
    )
    with pytest.raises(TooLittleEvidence, match=expected):
        calibrate(kind, exits, labels, 1.0, split="valid")
    with pytest.raises(TooLittleEvidence, match=expected):
        calibrated_family(kind, exits, labels, [0.0, 1.0], split="valid")
    with pytest.raises(TooLittleEvidence, match=expected):
        deploy.choose(kind, exits, labels, deploy.DeployTarget(1.0), split="valid")
    with pytest.raises(TooLittleEvidence, match=r"^valid has \d rows?: choosing .* needs at least"):
        risk_controlled_kind(kind, exits, 0.01, 0.1, split="valid")


def test_the_rule_counts_each_class():
    exits, labels = random_exits(400, [1, 2, 3], seed=2)
    ones = torch.nonzero(labels.eq(1)).view(-1)
    zeros = torch.nonzero(labels.eq(0)).view(-1)
    keep = torch.cat([zeros[:MIN_PER_CLASS], ones[:MIN_PER_CLASS]])
    check_split(*rows_of(exits, labels, keep), "entropy")  # exactly enough: accepted
    short = torch.cat([zeros[: MIN_PER_CLASS - 1], ones[:200]])
    with pytest.raises(TooLittleEvidence, match=rf"class 0: {MIN_PER_CLASS - 1}, class 1: 200"):
        check_split(*rows_of(exits, labels, short), "entropy")
    check_split(exits, None, "entropy")  # no labels: rows in all
    need = rf"needs at least {2 * MIN_PER_CLASS} \({MIN_PER_CLASS} per class of the 2\)"
    few = rows_of(exits, labels, torch.arange(2 * MIN_PER_CLASS - 1))[0]
    with pytest.raises(TooLittleEvidence, match=need):
        check_split(few, None, "entropy")


def agreeing(n: int, layers=(1, 2, 3), classes: int = 2, seed: int = 0):
    """Every exit predicts the label, more confidently at depth: the exits always agree."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    exits = []
    for i, layer in enumerate(layers):
        x = torch.randn(n, classes, generator=gen) * 0.1
        x[torch.arange(n), labels] += 1.0 + i
        exits.append((layer, x))
    return exits, labels


def test_learned_needs_both_outcomes_in_every_fold():
    """Before: with every shallow exit agreeing, the fit's weights were all 0 and the policy
    let every row out at exit 1."""
    exits, labels = agreeing(60)
    assert all(abs(w) < 1e-9 for w in cross_fit(exits).model.weights)  # the fit alone: 0
    with pytest.raises(TooLittleEvidence, match="every shallow exit agrees with the final exit"):
        calibrate("learned", exits, labels, 1.0, split="valid")
    with pytest.raises(TooLittleEvidence, match="one outcome"):
        calibrate_learned(exits, labels, 1.0)
    # two disagreeing rows, both in one fold: that fold's fit sees one outcome
    from acl_fairseq.early_exit.learned_calibration import fold_ids

    folds = fold_ids(60, 5)
    rows = torch.nonzero(folds.eq(3)).view(-1)[:2]
    flipped = [(layer, x.clone()) for layer, x in exits]
    flipped[0][1][rows] = flipped[0][1][rows].flip(-1)
    message = re.escape("the learned kind's cross-fitting fold 4 of 5 would be fitted on rows ")
    with pytest.raises(TooLittleEvidence, match=message + r".*about 300 rows"):
        check_learned(flipped, "valid")
    calibrate("learned", *random_exits(300, [1, 2, 3], seed=3), 1.0)  # both outcomes: fitted


def test_degenerate_policies_are_named():
    exits, _ = random_exits(50, [1, 2, 3], seed=4)
    for policy in (
        EntropyPolicy(math.inf),
        MaxProbPolicy(0.0),
        PatiencePolicy(0),
        per_exit_policy("entropy", [1, 2], [math.inf, 0.3]),
        per_exit_policy("entropy", [2], [math.inf]),  # its first exit is 2
        LearnedPolicy(0.5, (0.0,) * 6, 1.0),  # every weight 0, sigmoid(1) > 0.5
        LearnedPolicy(0.0, (1.0,) * 6, -3.0),
    ):
        why = degenerate(policy, exits)
        first = min(policy.exits([1, 2]))
        assert why.startswith(f"{policy.spec} lets every row leave at exit {first} "), policy
    for policy in (
        EntropyPolicy(0.3),
        MaxProbPolicy(0.9),
        PatiencePolicy(1),
        EntropyPolicy(0.0),  # never exits
        LearnedPolicy(0.9, (0.0,) * 6, 1.0),  # every weight 0, never exits
        per_exit_policy("entropy", [1, 2], [0.1, math.inf]),
    ):
        assert degenerate(policy, exits) == "", policy


def test_a_degenerate_choice_is_deployed_only_with_a_warning(tmp_path):
    """On a split where the first exit always agrees, the fastest policy is entropy:inf: it
    is chosen, with a warning in its evidence and its saved file."""
    exits, labels = agreeing(40)
    choice = deploy.choose("entropy", exits, labels, deploy.DeployTarget(1.0), split="valid")
    assert choice.policy == EntropyPolicy(math.inf)
    assert choice.evidence["warning"].startswith("entropy:inf lets every row leave at exit 1")
    entry = deploy.entry(choice, exits, labels)
    (tmp_path / "checkpoint_best.pt").write_bytes(b"")
    deploy.save(tmp_path / "checkpoint_best.pt", {"fp32": entry}, deploy.DeployTarget(1.0), "f")
    saved = read_policy(tmp_path)
    assert saved.fields["warning"] == choice.evidence["warning"]
    assert "warning entropy:inf lets every row" in saved.describe()
    calibrated = deploy.choose("entropy", *random_exits(300, [1, 2, 3], seed=3),
                               deploy.DeployTarget(1.0))  # fmt: skip
    assert "warning" not in calibrated.evidence
