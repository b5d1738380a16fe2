"""Configuration: flags, environment twins, TOML, and one-line exit-2 errors for bad values."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarmnode.bench import quality_sim
from swarmnode.cli.main import build_parser
from swarmnode.core.diloco import DilocoConfig
from swarmnode.node.config import FLAGS, FlagGroup, NodeConfig, build_run_parser, load_config
from swarmnode.util.errors import ConfigError


def parse(argv: list[str], env: dict[str, str] | None = None, toml: Path | None = None) -> NodeConfig:
    args = build_parser().parse_args(["run", *argv])
    return load_config(vars(args), env or {}, toml)


def test_defaults_follow_the_design() -> None:
    cfg = parse([])
    assert (cfg.grpc_port, cfg.dht_port, cfg.metrics_port) == (50051, 8468, 9464)
    assert (cfg.outer_step_lr, cfg.outer_momentum) == (0.7, 0.9)
    assert parse(["--wire-dtype", "topk"]).outer_step_lr == 2.0  # the top-k wire's α (SparseLoCo's is 1)
    assert parse(["--wire-dtype", "topk", "--outer-lr", "0.5"]).outer_step_lr == 0.5
    assert cfg.identity_path == Path("swarmnode-data/identity.key")


def test_the_merge_default_is_the_one_the_quality_bench_chose() -> None:
    """`node/config.py` stays free of torch, so it spells α out; it must be core's (and the bench's)."""
    assert parse([]).outer_mix == DilocoConfig().outer_mix == quality_sim.DEFAULT_OUTER_MIX


def test_precedence_is_flag_over_env_over_toml(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('inner-steps = 7\nouter_lr = 0.5\nbatch-size = 3\npeers = ["a:1", "b:2"]\n')
    cfg = parse(["--inner-steps", "9"], {"SWARMNODE_INNER_STEPS": "8", "SWARMNODE_OUTER_LR": "0.6"}, toml)
    assert (cfg.inner_steps, cfg.outer_lr, cfg.batch_size) == (9, 0.6, 3)
    assert cfg.peers == ("a:1", "b:2")


def test_every_flag_has_an_env_twin() -> None:
    env = {
        "SWARMNODE_MATCHMAKING_TIMEOUT": "2.5",
        "SWARMNODE_PEERS": "node1:8468,10.0.0.2:9",
        "SWARMNODE_WIRE_DTYPE": "int8",
        "SWARMNODE_DATA_DIR": "/tmp/x",
    }
    cfg = parse([], env)
    assert cfg.matchmaking_timeout_s == 2.5 and cfg.peers == ("node1:8468", "10.0.0.2:9")
    assert cfg.wire_dtype == "int8" and cfg.data_dir == Path("/tmp/x")
    assert all(f.env == "SWARMNODE_" + f.option[2:].replace("-", "_").upper() for f in FLAGS)


@pytest.mark.parametrize(
    "argv",
    [
        ["--inner-steps", "0"],
        ["--inner-steps", "x"],
        ["--outer-lr", "-1"],
        ["--grpc-port", "70000"],
        ["--model", "huge"],
        ["--peers", "nohost"],
        ["--outer-momentum", "1.5"],
        ["--layout", "zip"],
        ["--shard", "20", "--num-shards", "4"],
        ["--run-id", "a b"],
        ["--tls-cert", "c.pem"],
        ["--hot-level", "99"],
        ["--seq-len", "100000", "--model", "tiny"],
        ["--reachable", "maybe"],
        ["--recovery-peers", "0"],
        ["--recovery-peers", "17"],
        ["--fragments", "0"],
        ["--inner-steps", "4", "--fragments", "5"],
        ["--outer-mix", "1"],
        ["--outer-mix", "-0.5"],
        ["--bulk-port", "70000"],
        ["--bulk-port", "on"],
    ],
)
def test_bad_values_exit_2_with_one_line_naming_the_flag(argv: list[str], tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "run", "--data-dir", str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert argv[0] in lines[0] or argv[-2] in lines[0]


def test_recovery_peers_has_an_environment_twin() -> None:
    assert parse([], {"SWARMNODE_RECOVERY_PEERS": "1"}).recovery_peers == 1
    assert parse(["--recovery-peers", "5"], {}).recovery_peers == 5
    with pytest.raises(ConfigError, match="SWARMNODE_RECOVERY_PEERS: must be in 1..16"):
        parse([], {"SWARMNODE_RECOVERY_PEERS": "0"})


def test_bulk_port_is_a_port_zero_for_any_or_off() -> None:
    assert parse([], {}).bulk_port == 0
    assert parse(["--bulk-port", "50052"], {}).bulk_port == 50052
    assert parse(["--bulk-port", "off"], {}).bulk_port is None
    assert parse([], {"SWARMNODE_BULK_PORT": "off"}).bulk_port is None
    with pytest.raises(ConfigError, match="--bulk-port: must be a port number 0-65535 .* or off"):
        parse(["--bulk-port", "lanes"], {})


def test_final_lr_fraction_sets_where_the_cosine_ends_from_flag_or_env() -> None:
    cosine = ["--lr-schedule", "cosine", "--total-steps", "100"]
    assert parse(cosine).inner_schedule.factor(100) == 0.0
    assert parse([*cosine, "--final-lr-fraction", "0.1"]).inner_schedule.factor(100) == 0.1
    assert parse(cosine, {"SWARMNODE_FINAL_LR_FRACTION": "0.05"}).inner_schedule.final_fraction == 0.05
    with pytest.raises(ConfigError, match="--final-lr-fraction: must be between 0 and 1"):
        parse([*cosine, "--final-lr-fraction", "1.5"])


def test_fragments_cut_each_h_steps_into_k_rounds_from_flag_or_env() -> None:
    cfg = parse(
        ["--inner-steps", "50", "--max-outer-steps", "8", "--lr-schedule", "cosine"],
        {"SWARMNODE_FRAGMENTS": "4"},
    )
    assert cfg.fragments == 4
    assert [cfg.round_steps(r) for r in range(8)] == [12, 13, 12, 13] * 2  # K rounds make H steps
    assert cfg.inner_schedule.total_steps == 100  # the cosine ends with the 8th fragment round
    assert [parse(["--inner-steps", "50"]).round_steps(r) for r in range(3)] == [50, 50, 50]


def test_bad_env_and_toml_values_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SWARMNODE_BATCH_SIZE: .*'-3'"):
        parse([], {"SWARMNODE_BATCH_SIZE": "-3"})
    toml = tmp_path / "bad.toml"
    toml.write_text("no-such-flag = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'no-such-flag'"):
        parse([], toml=toml)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"swarmnode = 3\n", "'swarmnode' in .* must be a table"),
        (b'swarmnode = "x"\n', "'swarmnode' in .* must be a table"),
        (b"inner-steps = 7 # \xff\xfe\n", "is not UTF-8 text"),
    ],
)
def test_a_toml_file_of_the_wrong_shape_is_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    toml = tmp_path / "node.toml"
    toml.write_bytes(content)
    with pytest.raises(ConfigError, match=f"--config: .*{message}"):
        parse([], toml=toml)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bulk-port", "7000", "--grpc-port", "7000"], "--bulk-port: port 7000 is also --grpc-port's"),
        (
            ["--metrics-port", "7001", "--grpc-port", "7001"],
            "--metrics-port: port 7001 is also --grpc-port's",
        ),
        (
            ["--bulk-port", "7002", "--metrics-port", "7002"],
            "--bulk-port: port 7002 is also --metrics-port's",
        ),
    ],
)
def test_two_listeners_on_one_port_name_the_clash(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv)
    assert parse(["--dht-port", "7003", "--grpc-port", "7003"]).dht_port == 7003  # UDP beside TCP is fine


def test_help_documents_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": ""},
    )
    assert out.returncode == 0
    for flag in FLAGS:
        assert flag.option in out.stdout, flag.option
    # the variables are named once, by rule, not repeated under every flag
    assert "SWARMNODE_<NAME>" in out.stdout


def test_help_groups_the_flags_with_the_common_ones_first() -> None:
    text = build_run_parser(argparse.ArgumentParser(prog="swarmnode run")).format_help()
    starts = [text.index(f"\n{group.value}:\n") for group in FlagGroup]
    assert starts == sorted(starts)
    common = text[starts[0] : starts[1]]
    for option in ("--peers", "--run-id", "--data-dir", "--model", "--data", "--config", "--dry-run"):
        assert option in common, option
    assert "\nother:\n" not in text


def test_each_flag_is_in_its_group() -> None:
    parser = build_run_parser(argparse.ArgumentParser(prog="swarmnode run"))
    options_of = {
        group.title: {option for action in group._group_actions for option in action.option_strings}
        for group in parser._action_groups
    }
    for flag in FLAGS:
        assert flag.group is not None and flag.option in options_of[flag.group.value], flag.option


def test_dry_run_prints_config_without_the_token(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmnode.cli",
            "run",
            "--dry-run",
            "--swarm-token",
            "s3cret",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "s3cret" not in out.stdout + out.stderr
    assert '"swarm_token": "***"' in out.stdout


def test_config_built_in_code_is_validated_too() -> None:
    with pytest.raises(ConfigError, match="--keep-hot"):
        NodeConfig(keep_hot=0)


def test_an_unparsable_tls_key_exits_2_at_start_up(tmp_path: Path) -> None:
    """The key is parsed once at start-up (it signs every call's proof), so a bad one fails there."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "k.pem").write_bytes(
        b"-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n"
    )
    argv = ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem")]
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "run", "--data-dir", str(tmp_path / "d"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].count("--tls-key") >= 1, out.stderr


def test_client_commands_check_their_security_flags_as_run_does(tmp_path: Path) -> None:
    """`status`/`fetch` take --swarm-token/--tls-* from the same flag table as `run` (and their env twins)."""
    env = {**os.environ, "SWARMNODE_SWARM_TOKEN": ""}
    out = subprocess.run(
        [sys.executable, "-m", "swarmnode.cli", "status", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "SWARMNODE_SWARM_TOKEN: must not be empty" in out.stderr


def test_help_shows_one_default_and_the_choices_of_each_flag() -> None:
    parser = build_run_parser(argparse.ArgumentParser(prog="swarmnode run"))
    actions = {action.dest: action for action in parser._actions}
    for flag in FLAGS:
        action = actions[flag.field]
        assert action.help is not None and action.help.count("default:") <= 1, action.help
        if flag.choices:
            assert action.metavar == "{" + ",".join(flag.choices) + "}"
    text = parser.format_help()
    for shown in (
        "--model tiny|small|base|hf:PATH|py:MOD:FN",
        "--layout {planes,plain}",
        "--device auto|cpu|cuda|cuda:N",
        "--precision {auto,fp32,bf16,fp16}",
    ):
        assert shown in text
    assert "--wire-dtype {fp32,bf16,int8,int4,topk}" in text
    assert actions["threads"].help == "CPU threads for torch (default: torch's own choice)"


def test_topk_wire_names_its_k_takes_overlap_and_refuses_fragments() -> None:
    cfg = parse(["--wire-dtype", "topk", "--topk-density", "0.0156"])
    assert (cfg.topk, cfg.group_wire_dtype) == (64, "topk64")
    assert parse([]).topk == 0 and parse([]).group_wire_dtype == "bf16"
    assert parse(["--wire-dtype", "topk", "--overlap", "on"]).overlap == "on"
    with pytest.raises(ConfigError, match="topk.*--fragments"):
        parse(["--wire-dtype", "topk", "--fragments", "2"])
    with pytest.raises(ConfigError):
        parse(["--wire-dtype", "topk", "--topk-density", "0"])
