from __future__ import annotations

from pathlib import Path

import pytest

from voice_out.config import (
    REMOVED_ENGINE_KEYS,
    Config,
    ConfigError,
    EngineConfig,
    IceServer,
    ServerConfig,
    load_config,
    parse_gpu_memory,
    parse_overrides,
    replace,
)

REPO = Path(__file__).resolve().parent.parent


def test_defaults_file_equals_dataclass_defaults() -> None:
    cfg = load_config(REPO / "configs" / "default.toml", environ={})
    base = load_config(None, environ={})
    # cache-dependent paths aside, the shipped file restates the defaults
    assert cfg.engine == base.engine
    assert cfg.server.port == base.server.port == 8080
    assert cfg.model.model == base.model.model == "FunAudioLLM/CosyVoice2-0.5B"


def test_priority_file_env_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[server]\nport = 9001\nhost = "0.0.0.0"\n[engine]\nmax_streams = 8\n')
    cfg = load_config(
        f,
        environ={
            "VOICE_OUT_SERVER_PORT": "9002",
            "VOICE_OUT_ENGINE_EAGER": "on",
            "VOICE_OUT_ENGINE_GPU_MEMORY": "80%",
        },
        overrides=parse_overrides(["server.port=9003", "engine.gpu_memory=22"]),
    )
    assert cfg.server.port == 9003
    assert cfg.server.host == "0.0.0.0"
    assert cfg.engine.max_streams == 8
    assert cfg.engine.eager is True and Config().engine.eager is False
    assert cfg.engine.gpu_memory == 22.0 and Config().engine.gpu_memory is None


def test_config_env_var_names_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[server]\nport = 7000\n")
    assert load_config(None, environ={"VOICE_OUT_CONFIG": str(f)}).server.port == 7000


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["server.port=70000"], "server.port = 70000 is invalid: expected an integer in 0..65535"),
        (["server.port=abc"], "server.port = 'abc' is invalid: expected an integer"),
        (["model.dtype=float8"], "model.dtype = 'float8' is invalid"),
        (["model.device=tpu"], "model.device = 'tpu' is invalid"),
        (["engine.top_p=1.5"], "engine.top_p = 1.5 is invalid"),
        (["engine.eager=maybe"], "expected true or false"),
        (["engine.gpu_memory=lots"], "engine.gpu_memory = 'lots' is invalid: expected GiB as a number"),
        (["engine.gpu_memory=0"], "engine.gpu_memory = 0.0 is invalid"),
        (["engine.gpu_memory=150%"], "a percentage must be in (0, 100]"),
        (["engine.first_hop_tokens=200"], "engine.first_hop_tokens = 200 is invalid"),
        (["engine.max_ahead_s=0"], "engine.max_ahead_s = 0.0 is invalid"),
        (["engine.cuda_graphs=false"], "engine.cuda_graphs is no longer a setting: engine.eager"),
        (["engine.capture_tokens=500"], "engine.capture_tokens is no longer a setting: derived from engine.gpu_memory"),
        (["server.auth_token=short"], "at least 8 characters"),
        (["server.nope=1"], "unknown key(s) in [server]: nope"),
        (["server.frame_ms=15"], "server.frame_ms = 15 is invalid: expected 10 or 20"),
    ],
)
def test_bad_values_get_precise_errors(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={}, overrides=parse_overrides(overrides))
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[server\nport=1", "not valid TOML"),
        ("[bogus]\nx=1\n", "unknown section [bogus]"),
        ("server = 3\n", "[server] must be a table"),
        ('[server]\nport = "x"\n', "server.port = 'x' is invalid"),
        ("[engine]\nmax_streams = true\n", "engine.max_streams = True is invalid"),
    ],
)
def test_bad_files(tmp_path: Path, text: str, fragment: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, environ={})
    assert fragment in str(e.value)


def test_missing_file_and_bad_env_and_bad_set() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/voice_out.toml", environ={})
    with pytest.raises(ConfigError, match="VOICE_OUT_SERVER_PROT"):
        load_config(None, environ={"VOICE_OUT_SERVER_PROT": "1"})
    with pytest.raises(ConfigError, match="expected SECTION.FIELD=VALUE"):
        parse_overrides(["port=1"])
    with pytest.raises(ConfigError, match="unknown section 'srv'"):
        parse_overrides(["srv.port=1"])


def test_frozen_and_replace() -> None:
    cfg = Config()
    with pytest.raises(AttributeError):
        cfg.server.port = 1  # type: ignore[misc]
    cfg2 = replace(cfg, "engine", max_streams=4)
    assert cfg2.engine.max_streams == 4 and cfg.engine.max_streams == 64
    with pytest.raises(ConfigError):
        replace(cfg, "engine", max_streams=0)
    assert isinstance(cfg2.engine, EngineConfig)


def test_ice_servers_from_toml_env_and_set(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        '[[server.ice_servers]]\nurls = "stun:stun.example.org"\n\n'
        "[[server.ice_servers]]\n"
        'urls = ["turn:turn.example.org:3478?transport=udp", "turns:turn.example.org:5349"]\n'
        'username = "agent"\ncredential = "secret"\n'
    )
    servers = load_config(f, environ={}).server.ice_servers
    assert servers == (
        IceServer(urls=("stun:stun.example.org",)),
        IceServer(
            urls=("turn:turn.example.org:3478?transport=udp", "turns:turn.example.org:5349"),
            username="agent",
            credential="secret",
        ),
    )
    assert servers[1].to_json() == {
        "urls": ["turn:turn.example.org:3478?transport=udp", "turns:turn.example.org:5349"],
        "username": "agent",
        "credential": "secret",
    }
    assert servers[0].to_json() == {"urls": ["stun:stun.example.org"]}
    # the environment and --set take the list as JSON
    as_json = '[{"urls": "turn:10.0.0.1?transport=tcp", "username": "u", "credential": "p"}]'
    expected = (IceServer(urls=("turn:10.0.0.1?transport=tcp",), username="u", credential="p"),)
    assert load_config(None, environ={"VOICE_OUT_SERVER_ICE_SERVERS": as_json}).server.ice_servers == expected
    overrides = parse_overrides([f"server.ice_servers={as_json}"])
    assert load_config(f, environ={}, overrides=overrides).server.ice_servers == expected
    assert load_config(f, environ={}, overrides=parse_overrides(["server.ice_servers="])).server.ice_servers == ()
    assert load_config(None, environ={}).server.ice_servers == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('[{"urls": "turn:1.2.3.4"}]', "server.ice_servers[0].username is missing: a TURN server (turn:1.2.3.4)"),
        (
            '[{"urls": "stun:a"}, {"urls": "turns:b", "username": "u"}]',
            "server.ice_servers[1].credential is missing",
        ),
        ('[{"urls": "turn:h", "username": "", "credential": "p"}]', "server.ice_servers[0].username is missing"),
        ('[{"urls": "http://stun.example.org"}]', "server.ice_servers[0].urls: 'http://stun.example.org' is invalid"),
        ('[{"urls": "stun:[::1]:3478"}]', "a host name or IPv4 address"),
        ('[{"urls": "stuns:stun.example.org"}]', "expected stun:HOST[:PORT]"),
        ('[{"urls": "stun:x:0"}]', "the port must be in 1..65535"),
        ('[{"urls": "stun:x?transport=udp"}]', "a stun: URL takes no transport"),
        ('[{"urls": "turns:x?transport=udp", "username": "u", "credential": "p"}]', "runs over TCP only"),
        ('[{"urls": "turn:x?transport=sctp", "username": "u", "credential": "p"}]', "is invalid"),
        ('[{"urls": []}]', "server.ice_servers[0].urls is empty"),
        ('[{"url": "stun:x"}]', "server.ice_servers[0]: unknown key(s) url; known keys: urls, username, credential"),
        ("[{}]", "server.ice_servers[0]: missing key(s) urls"),
        ('[{"urls": "turn:x", "username": "u", "credential": 5}]', "server.ice_servers[0].credential = 5 is invalid"),
        ('["stun:x"]', "server.ice_servers[0] = 'stun:x' is invalid: expected a table of urls, username, credential"),
        ('{"urls": "stun:x"}', "expected a list"),
        ("stun:x", "expected a JSON list of tables"),
    ],
)
def test_bad_ice_servers(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={}, overrides=parse_overrides([f"server.ice_servers={value}"]))
    assert message in str(e.value)


def test_bad_ice_server_built_in_python() -> None:
    with pytest.raises(ConfigError, match=r"server.ice_servers\[0\].credential is missing"):
        ServerConfig(ice_servers=(IceServer(urls=("turn:turn.example.org",), username="u"),))


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        (22, ("gib", 22.0)),
        ("22", ("gib", 22.0)),
        ("0.8", ("fraction", 0.8)),
        ("80%", ("fraction", 0.8)),
        (1, ("fraction", 1.0)),
        ("8 GiB", ("gib", 8.0)),
        ("0.5GiB", ("gib", 0.5)),
    ],
)
def test_gpu_memory_is_gib_or_a_share_of_the_card(value: float | str, parsed: tuple[str, float]) -> None:
    assert parse_gpu_memory(value)[0] == parsed[0]
    assert parse_gpu_memory(value)[1] == pytest.approx(parsed[1])


def test_a_removed_engine_key_fails_in_one_line_naming_its_replacement(tmp_path: Path) -> None:
    """A config file, an environment variable or ``--set`` naming one of the GPU-mechanics keys
    that the plan now derives fails with one line saying what replaced it; the default config
    file sets none of them."""
    f = tmp_path / "old.toml"
    f.write_text("[engine]\nmax_streams = 8\nfirst_chunk_prefix_voices = 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, environ={})
    msg = str(e.value)
    assert "\n" not in msg
    assert (
        msg == f"engine.first_chunk_prefix_voices is no longer a setting: {REMOVED_ENGINE_KEYS['flow_state_streams']}"
    )
    with pytest.raises(ConfigError, match="engine.step_ahead_rows is no longer a setting"):
        load_config(None, environ={"VOICE_OUT_ENGINE_STEP_AHEAD_ROWS": "0"})
    assert len(REMOVED_ENGINE_KEYS) == 21
    default = load_config(REPO / "configs" / "default.toml", environ={})
    assert default.engine == EngineConfig(max_streams=64)


@pytest.mark.parametrize(
    ("spec", "devices"),
    [
        ("auto", ("auto",)),
        ("cuda:3", ("cuda:3",)),
        ("cuda:all", ("cuda:all",)),
        ("cuda:0,cuda:1", ("cuda:0", "cuda:1")),
        (" cuda:1 , cuda:0 ", ("cuda:1", "cuda:0")),
        ("cpu,cpu", ("cpu", "cpu")),
    ],
)
def test_model_device_takes_a_list_of_devices(spec: str, devices: tuple[str, ...]) -> None:
    cfg = load_config(None, environ={}, overrides=parse_overrides([f"model.device={spec}"]))
    assert cfg.model.devices == devices


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("cuda:0,cuda:0", "cuda:0 named twice (one engine per GPU)"),
        ("cuda:0,", "an empty item in the list"),
        ("cuda:0,cpu", "a list is all CPU (tests) or all cuda:N, not both"),
        ("cuda,cuda:1", "'cuda' cannot be part of a list"),
        ("cuda:all,cuda:1", "'cuda:all' cannot be part of a list"),
        ("auto,cpu", "'auto' cannot be part of a list"),
        ("cuda:x", "'cuda:x' is not a device"),
        ("cuda:01", "'cuda:01' is not a device"),
        ("gpu0", "'gpu0' is not a device"),
    ],
)
def test_bad_device_lists_get_precise_errors(spec: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, environ={}, overrides=parse_overrides([f"model.device={spec}"]))
    assert f"model.device = {spec!r} is invalid: {why}" in str(e.value)
    assert "cuda:0,cuda:1" in str(e.value)  # what is accepted


def test_engine_processes_is_checked() -> None:
    with pytest.raises(ConfigError, match="model.engine_processes = 'threads' is invalid: expected one of auto"):
        load_config(None, environ={}, overrides=parse_overrides(["model.engine_processes=threads"]))
