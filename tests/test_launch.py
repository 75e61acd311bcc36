"""The launch files (tools/launch/): they parse, and start `jaxllm train` with keys the configuration has.

Neither is run on a cluster here (docs/launching.md says so); tests/test_multiprocess.py starts two processes
with SLURM's environment and JAX's SLURM detection.
"""

import shlex
import subprocess

import yaml

from harness import REPO
from jaxllm.config import build_config

LAUNCH = REPO / "tools" / "launch"


def _overrides(args: list[str]) -> list[str]:
    """The `key=value` arguments of a `jaxllm train` command line (read by build_config as the command reads them)."""
    return [a for a in args if "=" in a and not a.startswith("-")]


def test_the_sbatch_script_is_valid_bash_and_starts_jaxllm_through_srun_with_slurm_detection():
    script = (LAUNCH / "slurm.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(LAUNCH / "slurm.sbatch")]).returncode == 0
    options = [line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH ")]
    assert "--ntasks-per-node=1" in options and any(o.startswith("--signal=TERM@") for o in options)
    [launch] = [line for line in script.splitlines() if line.startswith("srun ")]
    words = shlex.split(launch)
    args = words[words.index("jaxllm") + 2:]
    assert words[words.index("jaxllm") + 1] == "train" and args[-1] == "$@"
    cfg = build_config(None, _overrides(args))
    assert cfg.distributed.auto and cfg.train.resume and not cfg.distributed.coordinator_address


def test_the_jobset_manifest_parses_and_its_pods_may_read_what_jax_asks_kubernetes():
    docs = list(yaml.safe_load_all((LAUNCH / "jobset.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert sorted(kinds) == ["JobSet", "Role", "RoleBinding", "ServiceAccount"]
    jobset = kinds["JobSet"]
    assert jobset["apiVersion"].startswith("jobset.x-k8s.io/")
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    assert job["parallelism"] == job["completions"]  # one pod per host, each its own process index
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    binding = kinds["RoleBinding"]
    assert binding["roleRef"]["name"] == kinds["Role"]["metadata"]["name"]
    assert [s["name"] for s in binding["subjects"]] == [pod["serviceAccountName"]]
    granted = {r for rule in kinds["Role"]["rules"] for r in rule["resources"]}
    assert {"pods", "services", "jobs"} <= granted  # what JAX's Kubernetes detection reads
    [container] = pod["containers"]
    assert container["command"] == ["jaxllm", "train"]
    cfg = build_config(None, _overrides(container["args"]))
    assert cfg.distributed.auto and cfg.train.resume and cfg.mesh.dcn.dp == job["parallelism"]
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(cfg.run.dir.startswith(path + "/") for path in mounted)  # run.dir on the shared volume
