"""The CLI explains itself: `swarmnode identity` gives the node id and a certificate request naming it,
a node serving beyond loopback without token or TLS says so, and a peer of another configuration is
told which settings differ."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from swarmnode.bench.pki import make_ca
from swarmnode.cli import commands, units
from swarmnode.cli import main as cli
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.gpt_spec import GptSpec
from swarmnode.core.training import (
    MAX_SETTINGS_BYTES,
    digest_of_settings,
    run_digest,
    run_settings,
    settings_differences,
    settings_json,
)
from swarmnode.net import rpc
from swarmnode.net.identity import Identity
from swarmnode.net.security import Security
from swarmnode.node.config import NodeConfig
from swarmnode.node.startup import exposure_warning


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_identity_prints_the_node_id_and_creates_the_key_once(tmp_path: Path, capsys) -> None:
    code, out, _ = run_cli(capsys, "identity", "--data-dir", str(tmp_path))
    assert code == 0 and out == [Identity.load_or_create(tmp_path / "identity.key").node_id_hex]
    assert run_cli(capsys, "identity", "--data-dir", str(tmp_path))[1] == out  # the same key, not a new one


def sign(csr_pem: bytes, ca: tuple[x509.Certificate, object]) -> bytes:
    csr = x509.load_pem_x509_csr(csr_pem)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(ca[0].subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(ca[1], hashes.SHA256())  # type: ignore[arg-type]
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_the_certificate_request_names_the_node_id_and_its_signed_certificate_passes(
    tmp_path: Path, capsys
) -> None:
    csr = tmp_path / "node.csr"
    code, out, _ = run_cli(
        capsys, "identity", "--data-dir", str(tmp_path), "--csr", str(csr), "--name", "203.0.113.5"
    )
    node_id = out[0]
    request = x509.load_pem_x509_csr(csr.read_bytes())
    assert code == 0 and request.is_signature_valid
    assert request.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == node_id
    san = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["203.0.113.5"]
    key = tmp_path / "node.key"
    assert key.stat().st_mode & 0o077 == 0  # the new TLS key is the owner's alone
    ca = make_ca("test CA")
    (tmp_path / "ca.pem").write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    (tmp_path / "node.pem").write_bytes(sign(csr.read_bytes(), ca))
    security = Security.from_files(None, tmp_path / "node.pem", key, tmp_path / "ca.pem")
    security.check_node_certificate(node_id)  # what a node with --tls-ca checks at start


def test_a_bad_tls_key_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "bad.key").write_text("not a key")
    code, _, err = run_cli(
        capsys, "identity", "--data-dir", str(tmp_path), "--csr", str(tmp_path / "x.csr"),
        "--tls-key", str(tmp_path / "bad.key"),
    )  # fmt: skip
    assert code == 2 and len(err) == 1 and "--tls-key" in err[0], err
    assert not (tmp_path / "x.csr").exists()


@pytest.mark.parametrize(
    "host, token, warned",
    [
        ("0.0.0.0", None, True),
        ("0.0.0.0", "secret", False),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
    ],
)
def test_serving_beyond_loopback_without_token_or_tls_is_warned(
    tmp_path: Path, host: str, token: str | None, warned: bool
) -> None:
    warning = exposure_warning(NodeConfig(host=host, swarm_token=token, data_dir=tmp_path))
    assert (warning is not None) == warned
    if warned:
        assert "--swarm-token" in warning and "\n" not in warning


def test_dry_run_prints_the_warning_on_stderr(tmp_path: Path, capsys) -> None:
    argv = ["run", "--dry-run", "--data-dir", str(tmp_path / "d"), "--model", "tiny"]
    code, _, err = run_cli(capsys, *argv, "--grpc-port", "0", "--dht-port", "0", "--metrics-port", "0")
    assert code == 0 and len(err) == 1 and "warning: serving on 0.0.0.0" in err[0], err


def settings(**changes: object) -> str:
    diloco = DilocoConfig(**{k: v for k, v in changes.items() if k in ("outer_lr", "fragments")})  # type: ignore[arg-type]
    seed = int(changes.get("seed", 0))  # type: ignore[call-overload]
    return settings_json(run_settings(GptSpec.preset("tiny", 256), 64, 16, seed, diloco, "c0ffee"))


def test_the_run_digest_hashes_the_settings_it_reports() -> None:
    ours = json.loads(settings())
    digest = run_digest(GptSpec.preset("tiny", 256), 64, 16, 0, DilocoConfig(), "c0ffee")
    assert digest == digest_of_settings(ours)


def test_a_configuration_mismatch_names_each_setting_and_both_values() -> None:
    assert settings_differences(settings(), settings()) == []
    assert settings_differences(settings(), settings(seed=7)) == ["seed: theirs 7, ours 0"]
    lines = settings_differences(settings(), settings(outer_lr=1.0, fragments=4))
    assert lines == ["fragments: theirs 4, ours (none)", "outer_lr: theirs 1.0, ours 0.7"]


def test_a_peers_settings_are_bounded_and_must_be_an_object() -> None:
    with pytest.raises(ValueError):
        settings_differences(settings(), "[1, 2]")
    with pytest.raises(ValueError):
        settings_differences(settings(), json.dumps({"x": "y" * MAX_SETTINGS_BYTES}))
    many = json.dumps({f"k{i}": i for i in range(20)})
    lines = settings_differences(settings(), many)
    assert len(lines) == 9 and lines[-1].startswith("and ")


def subcommand_parsers(
    parser: argparse.ArgumentParser, prefix: str = ""
) -> dict[str, argparse.ArgumentParser]:
    found = {prefix.strip(): parser} if prefix else {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(subcommand_parsers(sub, f"{prefix} {name}"))
    return found


def test_every_argument_of_every_subcommand_explains_itself() -> None:
    missing = [
        f"{command}: {action.option_strings or action.dest}"
        for command, parser in subcommand_parsers(cli.build_parser()).items()
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and not action.help
    ]
    assert missing == []


def test_status_prints_figures_rounded_with_units() -> None:
    status = rpc.NodeStatus(
        node_id="ab" * 20,
        run_id="r",
        uptime_s=192.4,
        tokens_per_s=1937.41,
        last_loss=3.768412,
        last_group=("a", "b", "c"),
        last_coverage=1.0,
        last_allreduce_s=0.00013383900022745365,
        snapshots=(rpc.SnapshotMeta("cd" * 32, 6_512_345, 3, 120, "hot", 0.0, "planes", "r", "ab" * 20),),
    )
    text = commands.format_status(status)
    assert "up 3 min 12 s" in text and "1,937 tokens/s" in text and "loss 3.7684" in text
    assert "coverage 100%" in text and "all-reduce 0.13 ms" in text and "6.5 MB" in text
    assert "0.000133" not in text and "6512345" not in text


@pytest.mark.parametrize(
    "seconds, shown",
    [
        (0.000134, "0.13 ms"),
        (0.134, "134 ms"),
        (4.23, "4.2 s"),
        (42.4, "42 s"),
        (192, "3 min 12 s"),
        (7380, "2 h 03 min"),
    ],
)
def test_durations_read_as_people_read_them(seconds: float, shown: str) -> None:
    assert units.duration(seconds) == shown
