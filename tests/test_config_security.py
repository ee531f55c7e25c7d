"""Configuration of issue 17's security settings: `<security>` (client
tokens with allowed actions, `*_file` secrets), `<cluster secret_file>` and
`<tls>`. Every error names the file, the element and the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qserver.config import (
    ACTION_NAMES,
    ALL_ACTIONS,
    MIN_TOKEN_LENGTH,
    ClientCert,
    ClientToken,
    Config,
    load_config,
    parse_json,
    parse_xml,
)
from qserver.errors import ConfigError
from qserver.wire.requests import parse_request

GOOD = "a" * MIN_TOKEN_LENGTH  # the shortest token taken
OTHER = "b" * 24


def xml(body: str) -> str:
    return f'<config>\n  <node_info node_id="1" port="1111"/>\n{body}\n</config>\n'


def load(tmp_path: Path, body: str, name: str = "node.xml") -> Config:
    path = tmp_path / name
    path.write_text(xml(body))
    return load_config(str(path))


def refused(tmp_path: Path, body: str, element: str, *words: str) -> ConfigError:
    """Loading `body` fails with an error that names the file, `element`,
    and every one of `words` in its problem."""
    path = tmp_path / "bad.xml"
    path.write_text(xml(body))
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    exc = info.value
    assert exc.file == str(path)
    assert exc.element == element
    for word in words:
        assert word in exc.problem, (word, exc.problem)
    text = str(exc)
    assert str(path) in text and f"<{element}>" in text and exc.problem in text
    return exc


# -- <security>: tokens ---------------------------------------------------------


def test_no_security_no_auth():
    config = parse_xml(xml(""))
    assert config.client_tokens == () and not config.auth_required
    assert not Config.default().auth_required


def test_one_client_token_allows_everything():
    config = parse_xml(xml(f'<security client_token="{GOOD}"/>'))
    assert config.auth_required
    (token,) = config.client_tokens
    assert (token.name, token.token, token.actions) == ("default", GOOD, ALL_ACTIONS)
    assert all(token.allows(a) for a in ALL_ACTIONS)
    assert not token.allows(0) and not token.allows(99) and not token.allows("1")


def test_named_tokens_with_actions():
    config = parse_xml(xml(f"""
      <security>
        <token name="producer" token="{GOOD}" actions="produce"/>
        <token name="worker" token="{OTHER}" actions="consumer, monitor"/>
        <token name="watch" token="{'c' * 20}" actions="read"/>
        <token name="ops" token="{'d' * 20}" actions="admin,8,104"/>
        <token name="root" token="{'e' * 20}" actions="all"/>
        <token name="star" token="{'f' * 20}" actions="*"/>
        <token name="plain" token="{'g' * 20}"/>
      </security>"""))
    tokens = {t.name: t for t in config.client_tokens}
    assert tokens["producer"].actions == {1}
    assert tokens["worker"].actions == {2, 3, 9, 10, 4, 104}
    # read-only: monitor (both forms), list (both), leader, show, peek, health
    assert tokens["watch"].actions == {4, 104, 7, 107, 8, 11, 12, 109}
    assert tokens["ops"].actions == {5, 6, 20, 108, 8, 104}
    for name in ("root", "star", "plain"):
        assert tokens[name].actions == ALL_ACTIONS
    assert not tokens["watch"].allows(1) and tokens["watch"].allows(4)


def test_client_token_and_named_tokens_together():
    config = parse_xml(xml(f'<security client_token="{GOOD}">'
                           f'<token name="r" token="{OTHER}" actions="read"/></security>'))
    assert [t.name for t in config.client_tokens] == ["default", "r"]


def test_token_is_not_in_repr():
    token = ClientToken(name="n", token=GOOD)
    assert GOOD not in repr(token)
    config = parse_xml(xml(f'<security client_token="{GOOD}"/>'))
    assert GOOD not in repr(config)


def test_every_action_the_wire_knows_can_be_granted():
    # A token's actions are checked against ACTION_NAMES: an action the
    # server parses but no name grants could never be allowed (it fails
    # closed, qserver.auth), and one named but unknown would be a typo.
    parsed = set()
    for action in range(0, 300):
        try:
            parse_request({"action": action, "queue": "q", "msg_id": 1, "data": "x"})
        except Exception as exc:  # BadRequest: anything but "invalid action" means known
            if "invalid action" in str(exc):
                continue
        parsed.add(action)
    assert parsed - {0} <= ALL_ACTIONS  # 0 (auth) needs no permission
    assert {a for actions in ACTION_NAMES.values() for a in actions} == ALL_ACTIONS


def test_token_files_are_relative_to_the_config_file(tmp_path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "default.txt").write_text(f"  {GOOD}\n")
    (secrets / "reader.txt").write_text(OTHER + "\n")
    (secrets / "cluster.txt").write_text("cluster-secret\n")
    config = load(tmp_path, """
      <cluster secret_file="secrets/cluster.txt"><node id="1" port="1101"/></cluster>
      <security client_token_file="secrets/default.txt">
        <token name="reader" token_file="secrets/reader.txt" actions="read"/>
      </security>""")
    assert [(t.name, t.token) for t in config.client_tokens] == [("default", GOOD),
                                                                ("reader", OTHER)]
    assert config.secret == "cluster-secret"


def test_absolute_token_file(tmp_path):
    path = tmp_path / "abs.txt"
    path.write_text(GOOD)
    config = load(tmp_path, f'<security client_token_file="{path}"/>')
    assert config.client_tokens[0].token == GOOD


def test_token_file_missing(tmp_path):
    exc = refused(tmp_path, '<security><token name="p" token_file="nope.txt"/></security>',
                  "security/token", "token_file=", "cannot read")
    assert str(tmp_path / "nope.txt") in exc.problem  # the path it looked at


def test_token_file_empty(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    refused(tmp_path, '<security client_token_file="empty.txt"/>', "security", "is empty")


def test_token_and_token_file_both(tmp_path):
    (tmp_path / "t.txt").write_text(GOOD)
    refused(tmp_path, f'<security><token name="p" token="{OTHER}" token_file="t.txt"/>'
                      '</security>', "security/token", "not both")


@pytest.mark.parametrize("token", ["short", "x" * (MIN_TOKEN_LENGTH - 1)])
def test_short_token(tmp_path, token):
    refused(tmp_path, f'<security client_token="{token}"/>', "security",
            f"at least {MIN_TOKEN_LENGTH} characters")
    refused(tmp_path, f'<security><token name="p" token="{token}"/></security>',
            "security/token", f"at least {MIN_TOKEN_LENGTH} characters")


def test_short_token_in_a_file(tmp_path):
    (tmp_path / "t.txt").write_text("tiny\n")
    refused(tmp_path, '<security client_token_file="t.txt"/>', "security",
            f"at least {MIN_TOKEN_LENGTH} characters")


def test_token_with_white_space(tmp_path):
    refused(tmp_path, f'<security client_token="{GOOD} {GOOD}"/>', "security", "white space")


def test_duplicate_token_names(tmp_path):
    refused(tmp_path, f'<security><token name="p" token="{GOOD}"/>'
                      f'<token name="p" token="{OTHER}"/></security>',
            "security/token", "duplicate token name 'p'")


def test_default_name_taken_by_client_token(tmp_path):
    refused(tmp_path, f'<security client_token="{GOOD}"><token name="default" '
                      f'token="{OTHER}"/></security>', "security/token", "duplicate")


def test_same_secret_twice(tmp_path):
    exc = refused(tmp_path, f'<security><token name="p" token="{GOOD}"/>'
                            f'<token name="q" token="{GOOD}"/></security>',
                  "security/token", "same secret", "'p'", "'q'")
    assert GOOD not in str(exc)  # the error names tokens, never their text


@pytest.mark.parametrize("actions,bad", [("produce,consme", "consme"), ("write", "write"),
                                         ("1,99", "99"), ("0", "0"), ("-1", "-1")])
def test_unknown_action_names(tmp_path, actions, bad):
    exc = refused(tmp_path, f'<security><token name="p" token="{GOOD}" actions="{actions}"/>'
                            '</security>', "security/token", f"unknown action {bad!r}")
    assert "produce" in exc.problem and "read" in exc.problem  # lists what is known


def test_empty_actions(tmp_path):
    refused(tmp_path, f'<security><token name="p" token="{GOOD}" actions=" , "/></security>',
            "security/token", "at least one action")


@pytest.mark.parametrize("name", ["", "a b", "x" * 65])
def test_bad_token_name(tmp_path, name):
    refused(tmp_path, f'<security><token name="{name}" token="{GOOD}"/></security>',
            "security/token", "name=")


def test_token_without_name_or_secret(tmp_path):
    refused(tmp_path, f'<security><token token="{GOOD}"/></security>', "security/token",
            "missing attribute 'name'")
    refused(tmp_path, '<security><token name="p"/></security>', "security/token",
            "missing attribute 'token'")


def test_security_without_tokens(tmp_path):
    refused(tmp_path, "<security/>", "security", "no client token")


def test_security_unknown_parts(tmp_path):
    refused(tmp_path, f'<security client_token="{GOOD}" tokens="x"/>', "security",
            "unknown attribute 'tokens'")
    refused(tmp_path, f'<security><user name="p" token="{GOOD}"/></security>',
            "security/user", "unknown element")
    refused(tmp_path, f'<security><token name="p" token="{GOOD}" action="read"/></security>',
            "security/token", "unknown attribute 'action'")
    refused(tmp_path, f'<security client_token="{GOOD}"/><security client_token="{OTHER}"/>',
            "security", "given twice")


# -- <cluster secret_file> ------------------------------------------------------


def test_cluster_secret_file_problems(tmp_path):
    nodes = '<node id="1" port="1101"/>'
    refused(tmp_path, f'<cluster secret_file="missing.txt">{nodes}</cluster>', "cluster",
            "secret_file=", "cannot read")
    (tmp_path / "empty.txt").write_text("  \n")
    refused(tmp_path, f'<cluster secret_file="empty.txt">{nodes}</cluster>', "cluster",
            "is empty")
    (tmp_path / "s.txt").write_text("s")
    refused(tmp_path, f'<cluster secret="x" secret_file="s.txt">{nodes}</cluster>', "cluster",
            "not both")


# -- <tls> ----------------------------------------------------------------------


def pem_files(directory: Path) -> None:
    """Files that exist (the configuration checks presence; their content
    is qserver.tls's to judge, at start-up)."""
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (directory / name).write_text("-----BEGIN CERTIFICATE-----\n")


def test_tls_paths_relative_to_the_config_file(tmp_path):
    conf = tmp_path / "conf"
    (conf / "tls").mkdir(parents=True)
    pem_files(conf / "tls")
    config = load(conf, '<tls cert="tls/cert.pem" key="tls/key.pem" ca="tls/ca.pem" '
                        'client_cert="required"/>')
    assert config.tls
    assert (config.tls_cert, config.tls_key, config.tls_ca) == tuple(
        str(conf / "tls" / n) for n in ("cert.pem", "key.pem", "ca.pem"))
    assert config.tls_client_cert is ClientCert.REQUIRED


def test_udp_off_by_default_with_tls(tmp_path):
    pem_files(tmp_path)
    assert Config.default().udp and not Config.default().tls
    assert parse_xml(xml("")).udp
    config = load(tmp_path, '<tls cert="cert.pem" key="key.pem"/>')
    assert config.tls and not config.udp
    assert config.tls_client_cert is ClientCert.NONE and not config.tls_peers
    assert load(tmp_path, '<tls cert="cert.pem" key="key.pem" udp="1"/>').udp


def test_tls_needs_cert_and_key(tmp_path):
    pem_files(tmp_path)
    refused(tmp_path, '<tls cert="cert.pem"/>', "tls", "cert and key")
    refused(tmp_path, '<tls key="key.pem"/>', "tls", "cert and key")


def test_tls_missing_file(tmp_path):
    pem_files(tmp_path)
    exc = refused(tmp_path, '<tls cert="cert.pem" key="nokey.pem"/>', "tls", "key=",
                  "no such file")
    assert str(tmp_path / "nokey.pem") in exc.problem
    refused(tmp_path, '<tls cert="cert.pem" key="key.pem" ca="noca.pem"/>', "tls", "ca=",
            "no such file")


@pytest.mark.parametrize("value", ["optional", "required"])
def test_client_cert_without_ca(tmp_path, value):
    pem_files(tmp_path)
    refused(tmp_path, f'<tls cert="cert.pem" key="key.pem" client_cert="{value}"/>', "tls",
            f"client_cert={value!r} needs ca")


def test_tls_bad_values(tmp_path):
    pem_files(tmp_path)
    refused(tmp_path, '<tls cert="cert.pem" key="key.pem" client_cert="yes"/>', "tls",
            "none|optional|required")
    refused(tmp_path, '<tls cert="cert.pem" key="key.pem" udp="maybe"/>', "tls", "1 or 0")
    refused(tmp_path, '<tls cert="cert.pem" key="key.pem" peers="1"/>', "tls",
            "peers=1 needs ca")
    refused(tmp_path, '<tls cert="cert.pem" key="key.pem" verify="1"/>', "tls",
            "unknown attribute 'verify'")


# -- the JSON format --------------------------------------------------------------


def test_json_security_and_tls(tmp_path):
    pem_files(tmp_path)
    (tmp_path / "reader.txt").write_text(OTHER)
    doc = {"node_id": 1, "port": 1111, "client_token": GOOD,
           "client_tokens": [{"name": "reader", "token_file": "reader.txt",
                              "actions": "read"}],
           "tls_cert": "cert.pem", "tls_key": "key.pem", "tls_ca": "ca.pem",
           "tls_client_cert": "optional", "tls_udp": 1}
    path = tmp_path / "node.json"
    path.write_text(json.dumps(doc))
    config = load_config(str(path))
    assert [(t.name, t.token) for t in config.client_tokens] == [("default", GOOD),
                                                                ("reader", OTHER)]
    assert config.tls_client_cert is ClientCert.OPTIONAL and config.udp
    assert config.tls_cert == str(tmp_path / "cert.pem")


def test_json_token_errors_name_the_key():
    with pytest.raises(ConfigError) as info:
        parse_json(json.dumps({"client_tokens": {"name": "x"}}), "c.json")
    assert (info.value.file, info.value.element) == ("c.json", "client_tokens")
    with pytest.raises(ConfigError) as info:
        parse_json(json.dumps({"client_tokens": [{"name": "x", "token": "short"}]}), "c.json")
    assert info.value.element == "client_tokens" and "at least" in info.value.problem
