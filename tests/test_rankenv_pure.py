"""Tier 1, with no process started: each rank's environment: the torchrun contract, precedence, profiles,
interfaces (core/rankenv.py, core/profiles.py)."""

from __future__ import annotations

import pytest

from launcher.core.errors import UsageError
from launcher.core.profiles import available_profiles, load_profile
from launcher.core.rankenv import CONTRACT_KEYS, contract_env, decide_env, parse_env_pairs
from launcher.core.topology import (
    NodeSlot,
    assign_ranks,
)

# What torchrun exports to each worker (torch/distributed/elastic/agent/server/local_elastic_agent.py),
# less the error-file and signal variables that only its own agent reads.
TORCHRUN_KEYS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
}  # fmt: skip


def _contract(rank=1, local_rank=1, node_rank=0):
    slot = assign_ranks([NodeSlot(0, "10.0.0.1", "n0"), NodeSlot(1, "10.0.0.2", "n1")], 2)[rank]
    return contract_env(
        slot,
        world_size=4,
        local_world_size=2,
        num_nodes=2,
        master_addr="10.0.0.1",
        master_port=29511,
        run_id="job",
        visible_devices="0,1",
    )


def test_contract_covers_torchrun_and_numbers_are_right():
    env = _contract(rank=3)
    assert TORCHRUN_KEYS <= set(env) == set(CONTRACT_KEYS)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["NODE_RANK"]) == ("3", "1", "1", "1")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29511")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the string torch compares with


def test_env_precedence_and_every_change_of_a_node_value_is_logged():
    d = decide_env(
        _contract(),
        node_env={"OMP_NUM_THREADS": "8", "NCCL_DEBUG": "INFO", "FOO": "node", "RANK": "7"},
        profile={"NCCL_DEBUG": "WARN", "FI_PROVIDER": "efa", "BAR": "profile"},
        profile_name="efa",
        overrides={"FOO": "cli", "BAR": "cli"},
    )
    s = d.to_set
    assert s["RANK"] == "1"  # contract wins
    assert "OMP_NUM_THREADS" not in s  # the node's own value is kept, not replaced by our default
    assert s["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # default where the node had none
    assert (s["NCCL_DEBUG"], s["FI_PROVIDER"]) == ("WARN", "efa")  # profile over node
    assert (s["FOO"], s["BAR"]) == ("cli", "cli")  # --env over node and profile
    notes = "\n".join(d.notes)
    for expected in (
        "RANK: node had '7'",
        "OMP_NUM_THREADS: keeping the node's '8'",
        "NCCL_DEBUG: profile efa sets 'WARN' over the node's 'INFO'",
        "FOO: --env sets its value over the node's 'node'",
        "BAR: --env sets its value over profile efa's",
    ):
        assert expected in notes
    assert "'cli'" not in notes  # --env values never reach the console


def test_env_defaults_apply_when_the_node_has_nothing():
    d = decide_env(_contract(), node_env={}, profile={}, profile_name=None, overrides={})
    assert d.to_set["OMP_NUM_THREADS"] == "1" and d.notes == ()


def test_env_pairs_are_checked():
    assert parse_env_pairs(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="--env A forwards this shell's A, which is not set"):
        parse_env_pairs(["A"], {})
    assert parse_env_pairs(["A"], {"A": "from the shell"}) == {"A": "from the shell"}  # as docker run -e A
    with pytest.raises(ValueError, match="sets MASTER_PORT, RANK, which the launcher sets"):
        parse_env_pairs(["RANK=0", "MASTER_PORT=1"])
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        parse_env_pairs(["1A=0"])


def test_efa_profile_holds_the_aws_values():
    env = load_profile("efa")
    assert env == {
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "NCCL_DEBUG": "WARN",
        "NCCL_BUFFSIZE": "8388608", "NCCL_P2P_NET_CHUNKSIZE": "524288", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": "1"}  # fmt: skip
    assert {"efa", "infiniband", "tcp", "cpu"} <= set(available_profiles())


def test_bad_profiles_say_what_to_do(tmp_path):
    with pytest.raises(UsageError, match="unknown env profile 'nope'; choose one of cpu, efa"):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env:\n  WORLD_SIZE: 3\n")
    with pytest.raises(UsageError, match="sets WORLD_SIZE, which the launcher sets"):
        load_profile(str(bad))
    empty = tmp_path / "empty.yaml"
    empty.write_text("description: nothing\n")
    with pytest.raises(UsageError, match="no `env:` mapping"):
        load_profile(str(empty))


def test_each_rank_names_the_interface_of_its_nodes_ray_ip_unless_told_otherwise():
    from launcher.core.rankenv import decide_envs
    from launcher.core.topology import RankSlot

    slots = [RankSlot(r, 0, r, r, 0, f"10.0.0.{r + 1}", f"n{r}") for r in range(3)]
    common = dict(world_size=3, local_world_size=1, num_nodes=3, master_addr="10.0.0.1", master_port=29500,
                  run_id="j", restart_count=0, max_restarts=0, profile_name="tcp", overrides={})  # fmt: skip
    node_envs = [{}, {"GLOO_SOCKET_IFNAME": "bond0"}, {}]
    d = decide_envs(slots, [(), (), ()], node_envs, profile={}, ifaces=["eth0", "ens5", None], **common)
    assert (d[0].to_set["GLOO_SOCKET_IFNAME"], d[0].to_set["NCCL_SOCKET_IFNAME"]) == ("eth0", "=eth0")
    assert "GLOO_SOCKET_IFNAME" not in d[1].to_set  # the node's own setting is kept, and said
    assert any("GLOO_SOCKET_IFNAME: keeping the node's 'bond0'" in n for n in d[1].notes)
    assert "GLOO_SOCKET_IFNAME" not in d[2].to_set  # interface unknown: nothing guessed
    profile = {"NCCL_SOCKET_IFNAME": "^docker,lo,veth"}  # env/tcp.yaml
    d = decide_envs(slots, [(), (), ()], [{}, {}, {}], profile=profile, ifaces=["eth0"] * 3, **common)
    assert (
        d[0].to_set["NCCL_SOCKET_IFNAME"] == "^docker,lo,veth" and d[0].to_set["GLOO_SOCKET_IFNAME"] == "eth0"
    )


def test_the_shell_s_variables_reach_ranks_but_not_the_machine_s_and_start_up_variables_are_told_apart():
    """#45 item 3: `FOO=1 torchrun train.py` gives every worker FOO; so does megaray, less what
    describes the driver's own machine, session or launcher (core/shellenv.py)."""
    from launcher.core.rankenv import startup_env
    from launcher.core.shellenv import forwarded_env, shown_names, startup_not_forwarded

    shell = {
        "FOO": "1", "MY_PASSWORD": "x", "DATA_DIR": "/data", "SSL_CERT_FILE": "/etc/ca.pem",
        "https_proxy": "http://p:3128", "HF_HOME": "/shared/hf", "NCCL_DEBUG": "INFO", "EDITOR": "vim",
        # the driver's machine, session and launcher: not forwarded
        "HOME": "/h", "PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib", "CUDA_PATH": "/usr/local/cuda",
        "CUDA_HOME": "/usr/local/cuda", "CUDA_VISIBLE_DEVICES": "0", "VIRTUAL_ENV": "/venv", "LC_ALL": "C",
        "TERM": "xterm", "SSH_AUTH_SOCK": "/tmp/ssh", "XDG_RUNTIME_DIR": "/run/user/0", "SLURM_PROCID": "0",
        "OMPI_COMM_WORLD_RANK": "0", "RAY_ADDRESS": "h:6379", "MEGARAY_STATE_DIR": "/s", "MASTER_ADDR": "h",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM", "CONDA_PREFIX": "/c", "BASH_FUNC_f%%": "() { :; }",
        "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATH": "/src", "MALLOC_ARENA_MAX": "2",
    }  # fmt: skip
    assert forwarded_env(shell) == {
        "DATA_DIR": "/data", "EDITOR": "vim", "FOO": "1", "HF_HOME": "/shared/hf", "MY_PASSWORD": "x",
        "NCCL_DEBUG": "INFO", "SSL_CERT_FILE": "/etc/ca.pem", "https_proxy": "http://p:3128",
    }  # fmt: skip
    # start-up variables reach a rank with --env NAME; the ones its process lacks are named (not paths)
    process = {"PYTHONUNBUFFERED": "1", "PATH": "/bin"}  # an image's ray start had PYTHONUNBUFFERED=1
    assert startup_not_forwarded(shell, process, {}) == ["MALLOC_ARENA_MAX", "PYTHONHASHSEED"]
    assert startup_not_forwarded(shell, process, {"PYTHONHASHSEED": "0"}) == ["MALLOC_ARENA_MAX"]
    assert shown_names(["A", "B"]) == "A, B"
    many = shown_names([f"V{i}" for i in range(30)])
    assert many.startswith("V0, V1,") and many.endswith(" and 20 more (spec.json in the run directory)")
    got = startup_env(
        profile={"LD_LIBRARY_PATH": "/opt/efa/lib", "NCCL_DEBUG": "WARN", "PYTHONHASHSEED": "1"},
        overrides={"PYTHONHASHSEED": "0", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    )
    assert got == {
        "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0",
        "LD_LIBRARY_PATH": "/opt/efa/lib",
        "PYTHONHASHSEED": "0",  # --env over the profile
    }


def test_a_blas_takes_the_threads_it_reads_at_load():
    from launcher.core.blas import blas_threads

    assert blas_threads("openblas", {"OMP_NUM_THREADS": "2"}, cpus=96) == 2
    assert blas_threads("openblas", {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "3"}, cpus=96) == 3
    assert blas_threads("mkl", {"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "4,2"}, cpus=96) == 4
    assert blas_threads("openblas", {"OMP_NUM_THREADS": "0"}, cpus=96) == 96  # unset or 0: every CPU
    assert blas_threads("flexiblas", {"OMP_NUM_THREADS": "2"}, cpus=96) is None  # not known: left alone


def test_the_command_line_ray_shows_has_its_secrets_redacted():
    from launcher.core.rankenv import redact_argv

    argv = ["python", "main.py", "--env", "API_TOKEN=s3cret", "--env=HF_HUB_TOKEN=hf_x", "--env", "LR=3e-4",
            "--address", "https://me:pw@head:8265", "train.py", "--key", "Bearer abc.def"]  # fmt: skip
    assert redact_argv(argv) == [
        "python", "main.py", "--env", "API_TOKEN=<redacted>", "--env=HF_HUB_TOKEN=<redacted>", "--env",
        "LR=3e-4", "--address", "https://me:<redacted>@head:8265", "train.py", "--key", "Bearer <redacted>",
    ]  # fmt: skip
