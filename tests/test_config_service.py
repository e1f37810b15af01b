"""ServiceConfig: YAML files in cluster_configs/ load; unknown keys and bad values are named."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollout_service.config import EngineConfig, ServiceConfig

CONFIGS = Path(__file__).resolve().parents[1] / "cluster_configs"


@pytest.mark.parametrize("name", ["local-cpu", "local-gpu", "multi-node"])
def test_shipped_service_configs_load_and_round_trip(name):
    cfg = ServiceConfig.from_yaml(str(CONFIGS / f"{name}.yaml"))
    assert isinstance(cfg.engine, EngineConfig)
    again = ServiceConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg
    cfg.sampling_params()  # the sampling defaults are valid SamplingParams


def test_shipped_configs_say_what_the_issue_asks():
    cpu = ServiceConfig.from_yaml(str(CONFIGS / "local-cpu.yaml"))
    assert cpu.num_workers == 2 and cpu.resources.num_gpus == 0 and cpu.engine.model == "smollm2-135m"
    gpu = ServiceConfig.from_yaml(str(CONFIGS / "local-gpu.yaml"))
    assert gpu.num_workers == "auto" and gpu.resources.num_gpus == 1
    multi = ServiceConfig.from_yaml(str(CONFIGS / "multi-node.yaml"))
    assert multi.placement.strategy == "STRICT_SPREAD" and multi.resources.custom
    launcher = yaml.safe_load((CONFIGS / "ray-cluster.yaml").read_text())
    assert {"cluster_name", "provider", "available_node_types", "head_node_type"} <= set(launcher)


def test_the_cluster_file_listens_on_loopback_and_authenticates_everywhere():
    launcher = yaml.safe_load((CONFIGS / "ray-cluster.yaml").read_text())
    starts = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    # the dashboard and its Jobs API (arbitrary code execution) on the head's loopback, Ray's default
    assert not any("--dashboard-host" in c or "0.0.0.0" in c for c in starts)
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert launcher["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"  # one token on every node


@pytest.mark.parametrize("bad, message", [
    ({"num_workerz": 2}, r"unknown key\(s\) \['num_workerz'\]"),
    ({"engine": {"modle": "x"}}, r"ServiceConfig.engine: unknown key\(s\) \['modle'\]"),
    ({"resources": {"gpus": 1}}, r"ServiceConfig.resources: unknown key\(s\) \['gpus'\]"),
    ({"num_workers": 0}, r"ServiceConfig.num_workers=0"),
    ({"num_workers": "many"}, r"ServiceConfig.num_workers='many'"),
    ({"num_workers": True}, r"ServiceConfig.num_workers=True"),
    ({"resources": {"num_cpus": -1}}, r"resources.num_cpus=-1"),
    ({"resources": {"num_gpus": "lots"}}, r"resources.num_gpus='lots'"),
    ({"resources": {"custom": {"rollout_node": 0}}}, r"resources.custom"),
    ({"resources": {"custom": {"GPU": 1}}}, r"use num_cpus / num_gpus"),
    ({"placement": {"strategy": "RANDOM"}}, r"placement.strategy='RANDOM'"),
    ({"placement": {"timeout_s": 0}}, r"placement.timeout_s=0"),
    ({"sampling": {"temperature": -1}}, r"ServiceConfig.sampling: SamplingParams.temperature"),
    ({"sampling": {"nn": 2}}, r"ServiceConfig.sampling: SamplingParams: unknown field"),
    ({"max_staleness": -1}, r"max_staleness=-1"),
    ({"max_staleness": 0.5}, r"max_staleness=0.5"),
    ({"max_restarts": -2}, r"max_restarts=-2"),
    ({"detached": "yes"}, r"detached='yes'"),
    ({"colocate": 1}, r"ServiceConfig.colocate=1: must be true or false"),
    ({"client_lease_s": 0}, r"ServiceConfig.client_lease_s=0: must be a number > 0"),
    ({"client_lease_s": -5.0}, r"client_lease_s=-5.0"),
    ({"client_lease_s": "1m"}, r"client_lease_s='1m'"),
    ({"client_lease_s": True}, r"client_lease_s=True"),
    ({"refresh_stall_s": 0}, r"ServiceConfig.refresh_stall_s=0: must be a number > 0"),
    ({"refresh_stall_s": "5m"}, r"refresh_stall_s='5m'"),
    ({"engine": {"page_size": 7}}, r"EngineConfig.page_size=7"),
    ({"name": ""}, r"ServiceConfig.name=''"),
    ({"engine": 3}, r"ServiceConfig.engine=3"),
])
def test_bad_values_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        ServiceConfig.from_dict(bad)


def test_yaml_errors_name_the_file(tmp_path):
    p = tmp_path / "svc.yaml"
    p.write_text("num_workers: [1,\n")
    with pytest.raises(ValueError, match=r"svc.yaml.*invalid YAML"):
        ServiceConfig.from_yaml(str(p))
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match=r"svc.yaml.*expected a mapping"):
        ServiceConfig.from_yaml(str(p))
    p.write_text("placement:\n  stratgy: PACK\n")
    with pytest.raises(ValueError, match=r"placement: unknown key\(s\) \['stratgy'\]"):
        ServiceConfig.from_yaml(str(p))
    with pytest.raises(ValueError, match="cannot read"):
        ServiceConfig.from_yaml(str(tmp_path / "missing.yaml"))


def test_every_error_in_a_file_names_the_file(tmp_path):
    p = tmp_path / "svc.yaml"
    for text, message in [
        ("engine:\n  max_num_seq: 8\n", r"ServiceConfig.engine: unknown key\(s\) \['max_num_seq'\] \(did you mean "
                                         r"'max_num_seqs'\?\)"),
        ("resources:\n  num_cpus: -1\n", r"ServiceConfig.resources.num_cpus=-1"),
        ("num_workers: 0\n", r"ServiceConfig.num_workers=0"),
        ("sampling:\n  temperature: -1\n", r"ServiceConfig.sampling: SamplingParams.temperature"),
    ]:
        p.write_text(text)
        with pytest.raises(ValueError, match=rf"^service config '{p}': {message}"):
            ServiceConfig.from_yaml(str(p))
        with pytest.raises(ValueError, match=rf"^service config '{p}': {message}"):
            ServiceConfig.load(str(p))


@pytest.mark.parametrize("text", ["", "\n\n", "# every line a comment\n# num_workers: 2\n"])
def test_an_empty_file_is_refused_not_run_on_defaults(tmp_path, text):
    p = tmp_path / "svc.yaml"
    p.write_text(text)
    with pytest.raises(ValueError, match=rf"^service config '{p}' is empty: write the settings you mean"):
        ServiceConfig.load(str(p))


def test_load_merges_overrides_key_by_key():
    cfg = ServiceConfig.load(str(CONFIGS / "local-cpu.yaml"), num_workers=3,
                             engine={"max_num_seqs": 8}, sampling={"max_tokens": 4})
    assert cfg.num_workers == 3 and cfg.engine.max_num_seqs == 8 and cfg.engine.model == "smollm2-135m"
    assert cfg.sampling["max_tokens"] == 4 and cfg.sampling["n"] == 2
    assert ServiceConfig.load(cfg) == cfg and ServiceConfig.load(cfg.to_dict()) == cfg
    assert ServiceConfig.load(None).num_workers == 2
    with pytest.raises(ValueError, match="expected a YAML path"):
        ServiceConfig.load(42)
    with pytest.raises(ValueError, match="unknown key"):
        ServiceConfig.load(cfg, bogus=1)


def test_colocate_and_the_client_lease_default_and_round_trip():
    cfg = ServiceConfig()
    assert cfg.colocate is False and cfg.client_lease_s == 60.0
    cfg = ServiceConfig.load(None, colocate=True, client_lease_s=2.5)
    assert cfg.colocate is True and cfg.client_lease_s == 2.5
    assert ServiceConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
