from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from agent import jobs
from experiment.core.canonical import identity
from experiment.core.errors import CoopError
from experiment.core.plan import load_plan, parse_plan, plan_identity

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "plans" / "reference.toml"
LOCAL = ROOT / "plans" / "local.toml"


def _edited(path: Path, old: str, new: str) -> bytes:
    text = path.read_text()
    assert old in text, old
    return text.replace(old, new, 1).encode()


def test_reference_plan_carries_the_protocol_numbers() -> None:
    plan = load_plan(REFERENCE)
    assert plan.seed.name == "HuggingFaceTB/SmolLM2-1.7B-Instruct"
    assert plan.seed.revision == "31b70e2e869a7173562077fd711b654946d38674"
    assert plan.seed.parameters == 1_711_376_384
    assert (plan.tasks.train, plan.tasks.dev, plan.tasks.test, plan.tasks.retention, plan.tasks.replay) == (
        768,
        64,
        256,
        128,
        256,
    )
    assert (plan.training.updates, plan.training.documents_per_update) == (128, 8)
    assert plan.training.peak_learning_rate == 3e-5
    assert plan.training.checkpoint_steps == [64, 128]
    assert (plan.runtime.device, plan.runtime.backend) == ("cuda", "nccl")
    assert plan.hosts.price_per_instance_hour == 1.861
    assert plan.training.deadline_hours == 6.0
    assert plan.serving.workload_tasks == 32 and plan.serving.concurrency == 2


def test_local_plan_keeps_every_rule_and_count_of_the_reference() -> None:
    local, reference = load_plan(LOCAL), load_plan(REFERENCE)
    assert local.tasks == reference.tasks
    assert local.corpus == reference.corpus
    assert local.evaluation.max_new_tokens == reference.evaluation.max_new_tokens
    # The numerics each answers in is its device's (plan.DEVICE_NUMERICS).
    assert (local.evaluation.numerics, reference.evaluation.numerics) == ("float32", "bfloat16")
    assert local.statistics == reference.statistics
    assert local.serving == reference.serving
    differing = {
        f
        for f in type(local.training).__struct_fields__
        if getattr(local.training, f) != getattr(reference.training, f)
    }
    assert differing <= {"peak_learning_rate"}
    assert (local.runtime.device, local.runtime.backend) == ("cpu", "gloo")


def test_plan_identity_ignores_comments_and_layout() -> None:
    plan = load_plan(LOCAL)
    reparsed = parse_plan(b"# a comment\n" + LOCAL.read_bytes() + b"\n\n", "edited")
    assert plan_identity(plan) == plan_identity(reparsed)
    changed = parse_plan(_edited(LOCAL, "schedule_seed = 20260913", "schedule_seed = 20260914"), "changed")
    assert plan_identity(changed) != plan_identity(plan)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("peak_learning_rate = ", "peak_learning_rate = -", "$.training.peak_learning_rate"),
        ("[training]", "[training]\nsurprise = 1", "surprise"),
        ('device = "cpu"', 'device = "tpu"', "$.runtime.device"),
        ("test = 256", "test = 0", "$.tasks.test"),
        ("updates = 128", "updates = 127", "training.updates x training.documents_per_update"),
        ("checkpoint_steps = [64, 128]", "checkpoint_steps = [64, 100]", "checkpoint_steps must end"),
        ('backend = "gloo"', 'backend = "nccl"', "runtime.backend must be gloo on cpu"),
        ("workload_tasks = 32", "workload_tasks = 65", "serving.workload_tasks"),
        ("max_new_tokens = 96\n", 'max_new_tokens = 96\nnumerics = "bfloat16"\n', "numerics must be float32 on cpu"),
        ("max_new_tokens = 96\n", 'max_new_tokens = 96\nnumerics = "float16"\n', "$.evaluation.numerics"),
    ],
)
def test_invalid_plan_is_refused_naming_the_field(old: str, new: str, field: str) -> None:
    with pytest.raises(CoopError, match="invalid plan") as refusal:
        parse_plan(_edited(LOCAL, old, new), "edited.toml")
    assert field in str(refusal.value)


def test_plan_that_is_not_toml_is_refused() -> None:
    with pytest.raises(CoopError, match="not valid TOML"):
        parse_plan(b"name = ", "broken.toml")


def test_missing_plan_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CoopError, match="cannot read plan"):
        load_plan(tmp_path / "absent.toml")


def _without_arms(path: Path) -> bytes:
    text = path.read_text()
    return text[: text.index("[[arms]]")].encode()


def test_the_plan_declares_its_arms_and_their_roles() -> None:
    plan = load_plan(LOCAL)
    assert plan.arm_names() == ("seed", "clean-single", "damaged-single", "clean-pair")
    assert plan.trained_arms() == ("clean-single", "damaged-single", "clean-pair")
    assert [plan.arm(role) for role in ("baseline", "clean", "damaged", "pair")] == list(plan.arm_names())
    assert plan.served_arm() == "clean-pair"
    assert [plan.world_size(arm) for arm in plan.arm_names()] == [1, 1, 1, plan.training.pair_world_size]
    assert plan.training_documents("damaged-single") == "train-damaged"
    assert plan.training_documents("clean-pair") == "train-clean"
    with pytest.raises(CoopError, match="untouched seed; it is not trained"):
        plan.training_documents("seed")
    with pytest.raises(CoopError, match="has no arm 'other'"):
        plan.world_size("other")


def test_a_plan_without_arms_has_the_reference_arms_and_keeps_its_identity() -> None:
    # A plan file with no [[arms]] table takes the reference arms; the arms it takes are not part of its identity.
    bare = parse_plan(_without_arms(LOCAL), "bare")
    assert bare.arms == () and bare.arm_names() == load_plan(LOCAL).arm_names()
    assert "arms" not in msgspec.to_builtins(bare)
    # The identity is that of the file's own content, as a plain TOML reader sees it.
    assert plan_identity(bare) == identity(msgspec.toml.decode(_without_arms(LOCAL)))
    assert plan_identity(load_plan(LOCAL)) == identity(msgspec.toml.decode(LOCAL.read_bytes()))


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ('name = "clean-pair"\nrole = "pair"\nserved = true', 'name = "clean-pair"\nrole = "pair"', "exactly one"),
        (
            'name = "damaged-single"\nrole = "damaged"',
            'name = "damaged-single"\nrole = "damaged"\nserved = true',
            "never",
        ),
        ('name = "clean-single"\nrole = "clean"', 'name = "clean-single"\nrole = "pair"', "one arm each"),
        ('name = "clean-single"', 'name = "seed"', "its own name"),
        ('name = "clean-single"', 'name = "Clean Single"', "arms"),
    ],
)
def test_arms_that_break_the_design_are_refused(old: str, new: str, problem: str) -> None:
    with pytest.raises(CoopError, match=problem):
        parse_plan(_edited(LOCAL, old, new), "edited")


def test_a_gpu_plan_answers_in_bfloat16_only() -> None:
    """vLLM's batch-invariant float32 matmuls on an L40S round through TF32, not the evaluation's float32."""
    with pytest.raises(CoopError, match=r"evaluation\.numerics must be bfloat16 on cuda"):
        parse_plan(_edited(REFERENCE, 'numerics = "bfloat16"', 'numerics = "float32"'), "edited.toml")


LOCAL_SGD_ARMS = """
[noninferiority]
margin = 0.05
max_p_value = 0.05

[[arms]]
name = "seed"
role = "baseline"

[[arms]]
name = "ddp-4"
role = "control"
ranks = 4

[[arms]]
name = "diloco-4"
role = "diloco"
ranks = 4
sync_every = 16
outer_learning_rate = 0.7
outer_momentum = 0.9
"""


def _local_sgd(old: str = "", new: str = "") -> bytes:
    hosts = _without_arms(LOCAL).decode().replace("\ncount = 2\n", "\ncount = 4\n")  # a host per rank of a gang
    return (hosts + LOCAL_SGD_ARMS.replace(old, new)).encode()


def test_a_local_sgd_plan_sets_diloco_against_its_matched_ddp_control() -> None:
    plan = parse_plan(_local_sgd(), "local-sgd")
    assert plan.design() == "local-sgd" and load_plan(LOCAL).design() == "reference"
    assert plan.arm_names() == ("seed", "ddp-4", "diloco-4") and plan.trained_arms() == ("ddp-4", "diloco-4")
    assert [plan.world_size(arm) for arm in plan.arm_names()] == [1, 4, 4]
    assert {plan.training_documents(arm) for arm in plan.trained_arms()} == {"train-clean"}
    assert plan.arm_plan("diloco-4").sync_every == 16 and plan.noninferiority is not None
    with pytest.raises(CoopError, match="serves no arm"):
        plan.served_arm()


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("ranks = 4\nsync_every", "ranks = 2\nsync_every", r"arms\[2\]\.ranks: 2 differs from its control ddp-4's 4"),
        ("ranks = 4", "ranks = 3", r"arms\[1\]\.ranks: .* split evenly over 3 ranks"),
        ('role = "control"\nranks = 4', 'role = "control"', r"arms\[1\]\.ranks: the control arm names"),
        ("sync_every = 16", "sync_every = 48", r"arms\[2\]\.sync_every: 48 must divide every checkpoint step"),
        ("outer_momentum = 0.9\n", "", r"arms\[2\]\.outer_momentum: DiLoCo's arm needs it"),
        ("ranks = 4\n\n", "ranks = 4\nsync_every = 16\n\n", r"arms\[1\]\.sync_every: the control synchronizes"),
        ("[noninferiority]\nmargin = 0.05\nmax_p_value = 0.05\n", "", "noninferiority: the local-SGD design needs"),
        ('role = "baseline"', 'role = "baseline"\nserved = true', "serves no arm"),
    ],
)
def test_a_diloco_arm_that_does_not_match_its_control_is_refused_naming_the_field(
    old: str, new: str, problem: str
) -> None:
    with pytest.raises(CoopError, match=problem):
        parse_plan(_local_sgd(old, new), "edited")


def test_a_plan_with_fewer_hosts_than_its_largest_gang_is_refused() -> None:
    three = _local_sgd().decode().replace("\ncount = 4\n", "\ncount = 3\n").encode()
    with pytest.raises(CoopError, match=r"hosts\.count: 3 hosts cannot hold a gang of 4 ranks"):
        parse_plan(three, "edited")


def test_the_reference_design_takes_no_local_sgd_fields() -> None:
    with pytest.raises(CoopError, match=r"arms\[1\]\.ranks: belongs to the local-SGD design"):
        parse_plan(_edited(LOCAL, 'role = "clean"', 'role = "clean"\nranks = 2'), "edited")
    with pytest.raises(CoopError, match="noninferiority: is the local-SGD design's criterion"):
        parse_plan(LOCAL.read_bytes() + b"\n[noninferiority]\nmargin = 0.05\nmax_p_value = 0.05\n", "edited")


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ('folder = "local-reference"', 'folder = "../../../../tmp/x"', "replay.folder"),
        ('folder = "local-reference"', 'folder = "/tmp/x"', "replay.folder"),
        ('path = "replay.jsonl"', 'path = "../../../etc/passwd"', "replay.replay.path"),
        ('path = "retention.jsonl"', 'path = "/etc/passwd"', "replay.retention.path"),
        ('"config.json" =', '"../../../../etc/passwd" =', "seed.files['../../../../etc/passwd']"),
    ],
)
def test_a_plan_path_outside_its_folder_is_refused_naming_the_field(old: str, new: str, field: str) -> None:
    with pytest.raises(CoopError, match=re.escape(field)):
        parse_plan(_edited(LOCAL, old, new), "edited")


def test_plan_show_refuses_a_plan_whose_replay_folder_leads_out_with_exit_2(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_bytes(_edited(LOCAL, 'folder = "local-reference"', 'folder = "../../../../tmp/x"'))
    shown = subprocess.run(
        [sys.executable, "-m", "experiment.cli", "plan", "show", str(plan)], capture_output=True, text=True, check=False
    )
    assert shown.returncode == 2 and "replay.folder" in shown.stderr and "'..'" in shown.stderr


def test_an_agent_links_no_replay_folder_that_leads_out_of_its_plans_folder(tmp_path: Path) -> None:
    plans, work = tmp_path / "plans", tmp_path / "work"
    (plans / "local-reference").mkdir(parents=True)
    (plans / "outward").symlink_to(tmp_path, target_is_directory=True)
    ws = jobs.Workspace(root=work, model_dir=tmp_path / "seed", plans_dir=plans)
    for folder in ("../../../../tmp/x", "/etc", "outward"):
        with pytest.raises(CoopError, match=r"replay\.folder"):
            jobs.link_replay_folder({"replay": {"folder": folder}}, ws)
    assert not [path for path in work.iterdir()]
    jobs.link_replay_folder({"replay": {"folder": "local-reference"}}, ws)
    assert (work / "local-reference").resolve() == (plans / "local-reference").resolve()
