"""The ansible roles without hosts: their layout, their argument specs
against their defaults, ansible.builtin modules only, the playbooks'
syntax, the systemd units they render (systemd-analyze verify), and
kiln-supervise, the supervisor of hosts without systemd."""

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest
import yaml

SRC = os.environ.get("KILN_SRC", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
ANSIBLE = os.path.join(SRC, "ansible")
ROLES = os.path.join(ANSIBLE, "roles")
ROLE_NAMES = ["kiln_common", "kiln_broker", "kiln_worker", "kiln_runtime", "kiln_artifact"]
PLAYBOOKS = ["site.yml", "deploy-artifact.yml", "rollback.yml", "fleet-status.yml"]
SUPERVISE = os.path.join(ROLES, "kiln_common", "files", "kiln-supervise")

needs_ansible = pytest.mark.skipif(not shutil.which("ansible-playbook"),
                                   reason="ansible-core is not installed (make deps)")

# Task keywords (Ansible's playbook keywords for tasks and blocks): every
# other key of a task names its module.
TASK_KEYWORDS = {
    "name", "when", "loop", "loop_control", "register", "notify", "listen", "become",
    "become_user", "delegate_to", "delegate_facts", "run_once", "changed_when", "failed_when",
    "until", "retries", "delay", "vars", "tags", "check_mode", "diff", "block", "rescue",
    "always", "no_log", "environment", "args", "ignore_errors", "ignore_unreachable",
    "any_errors_fatal", "throttle", "timeout", "with_items", "module_defaults", "collections",
}


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def tasks_in(items):
    for t in items or []:
        yield t
        for key in ("block", "rescue", "always"):
            if key in t:
                yield from tasks_in(t[key])


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_each_role_has_defaults_tasks_handlers_templates_and_an_argument_spec(role):
    r = os.path.join(ROLES, role)
    for f in ("defaults/main.yml", "tasks/main.yml", "handlers/main.yml", "meta/main.yml",
              "meta/argument_specs.yml"):
        assert os.path.isfile(os.path.join(r, f)), f"{role} lacks {f}"
    assert os.listdir(os.path.join(r, "templates")), f"{role} has no template"


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_argument_spec_documents_exactly_the_defaults_with_the_same_values(role):
    r = os.path.join(ROLES, role)
    defaults = load(os.path.join(r, "defaults/main.yml")) or {}
    options = load(os.path.join(r, "meta/argument_specs.yml"))["argument_specs"]["main"]["options"]
    required = {k for k, o in options.items() if o.get("required")}
    assert set(defaults) == set(options) - required, (
        f"{role}: in defaults only: {sorted(set(defaults) - set(options))}; "
        f"in the spec only: {sorted(set(options) - required - set(defaults))}")
    types = {"str": str, "path": str, "int": int, "bool": bool, "list": list, "dict": dict}
    for name, opt in options.items():
        assert opt.get("description"), f"{role}: {name} has no description"
        assert opt.get("type") in types, f"{role}: {name} has no known type"
        if name in required:
            assert "default" not in opt, f"{role}: {name} is required and has a default"
            continue
        assert "default" in opt, f"{role}: {name} has no default in the spec"
        want, spec = defaults[name], opt["default"]
        if isinstance(want, str) and isinstance(spec, str):
            assert " ".join(want.split()) == " ".join(spec.split()), f"{role}: {name}: {want!r} != {spec!r}"
        else:
            assert want == spec, f"{role}: {name}: defaults say {want!r}, the spec {spec!r}"
        if not (isinstance(want, str) and "{{" in want):
            assert isinstance(want, types[opt["type"]]), f"{role}: {name} is not a {opt['type']}"
        if "choices" in opt:
            assert want in opt["choices"], f"{role}: {name} default {want!r} not in its choices"


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_roles_use_only_ansible_builtin_modules(role):
    r = os.path.join(ROLES, role)
    for sub in ("tasks", "handlers"):
        for f in sorted(os.listdir(os.path.join(r, sub))):
            for task in tasks_in(load(os.path.join(r, sub, f))):
                modules = set(task) - TASK_KEYWORDS
                if "block" in task:
                    assert not modules, f"{role}/{sub}/{f}: a block with {modules}"
                    continue
                assert len(modules) == 1, f"{role}/{sub}/{f}: task {task.get('name')!r}: {modules}"
                module = modules.pop()
                assert module.startswith("ansible.builtin."), \
                    f"{role}/{sub}/{f}: task {task.get('name')!r} uses {module}"
                assert task.get("name"), f"{role}/{sub}/{f}: a task without a name ({module})"


@needs_ansible
@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbooks_pass_ansible_syntax_check(playbook, tmp_path):
    inv = tmp_path / "hosts.ini"
    inv.write_text("[kiln_broker]\nb\n[kiln_workers]\nw\n[kiln_inference]\ni\n")
    proc = subprocess.run(["ansible-playbook", "--syntax-check", "-i", str(inv),
                           os.path.join(ANSIBLE, playbook)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, ANSIBLE_ROLES_PATH=ROLES,
                                   ANSIBLE_HOME=str(tmp_path / "home")))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_ansible
def test_example_inventory_has_the_groups_the_playbooks_use(tmp_path):
    proc = subprocess.run(["ansible-inventory", "-i", os.path.join(ANSIBLE, "inventories", "example"),
                           "--list"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, ANSIBLE_HOME=str(tmp_path / "home")))
    assert proc.returncode == 0, proc.stderr
    inv = json.loads(proc.stdout)
    for group in ("kiln_broker", "kiln_workers", "kiln_inference"):
        assert inv.get(group, {}).get("hosts"), f"the example inventory has no {group}"


# --- the systemd units ------------------------------------------------------------

UNITS = [("kiln_broker", "kiln-broker", "kiln-broker"), ("kiln_worker", "kiln-worker", "kiln-worker"),
         ("kiln_runtime", "kiln-serve", "kiln-serve")]


@needs_ansible
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_units_are_hardened_and_pass_systemd_analyze_verify(tmp_path):
    """Render each role's unit from its own defaults and vars (the unit a
    real host gets), with the programs under a scratch prefix, and let
    systemd check it."""
    prefix = tmp_path / "opt"
    (prefix / "current" / "bin").mkdir(parents=True)
    for _, _, program in UNITS:
        exe = prefix / "current" / "bin" / program
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    out = tmp_path / "units"
    out.mkdir()
    play = [{
        "hosts": "localhost", "gather_facts": False, "connection": "local",
        "vars_files": [os.path.join(ROLES, "kiln_common", "defaults", "main.yml"),
                       os.path.join(ROLES, "kiln_common", "vars", "main.yml")]
        + [os.path.join(ROLES, role, d, "main.yml") for role, _, _ in UNITS for d in ("defaults", "vars")],
        "tasks": [{"name": f"render {unit}", "ansible.builtin.template": {
            "src": os.path.join(ROLES, role, "templates", unit + ".service.j2"),
            "dest": str(out / (unit + ".service"))}} for role, unit, _ in UNITS],
    }]
    pb = tmp_path / "render.yml"
    pb.write_text(yaml.safe_dump(play))
    inv = tmp_path / "hosts.ini"
    inv.write_text("[kiln_broker]\nlocalhost ansible_connection=local ansible_python_interpreter=/usr/bin/python3\n")
    proc = subprocess.run(["ansible-playbook", "-i", str(inv), str(pb),
                           "-e", json.dumps({"kiln_prefix": str(prefix), "kiln_user": "root",
                                             "kiln_group": "root", "kiln_runtime_cores": [0, 1]})],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, ANSIBLE_HOME=str(tmp_path / "home")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    for _, unit, _ in UNITS:
        path = out / (unit + ".service")
        text = path.read_text()
        for line in ("NoNewPrivileges=true", "ProtectSystem=strict", "Restart=always",
                     "CapabilityBoundingSet=", "ReadWritePaths="):
            assert line in text, f"{unit}.service lacks {line}"
        check = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                               capture_output=True, text=True, timeout=60)
        problems = [l for l in (check.stdout + check.stderr).splitlines()
                    if l.strip() and "Failed to open /etc/systemd" not in l
                    and "is not a directory" not in l]
        assert check.returncode == 0 and not problems, f"{unit}.service:\n{check.stdout}{check.stderr}"
    assert "CPUAffinity=0 1" in (out / "kiln-serve.service").read_text()
    assert "KILN_RT_VISIBLE_CORES=0,1" in (out / "kiln-serve.service").read_text()


# --- kiln-supervise ----------------------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="kiln-supervise runs as root")
def test_kiln_supervise_restarts_a_killed_service_and_stops_it():
    work = tempfile.mkdtemp(prefix="kiln-supervise-")
    specs, run = os.path.join(work, "specs"), os.path.join(work, "run")
    os.makedirs(specs, mode=0o755)
    env = dict(os.environ, KILN_SUPERVISE_SPECS=specs, KILN_SUPERVISE_RUN=run)
    log = os.path.join(work, "svc.log")
    with open(os.path.join(specs, "svc.json"), "w") as f:
        json.dump({"argv": ["/bin/sh", "-c", "echo up $GREETING; exec sleep 300"],
                   "env": {"GREETING": "hello"}, "user": "nobody", "group": "nogroup",
                   "cpus": [0], "log": log, "restart_sec": 0.2, "stop_timeout": 5}, f)
    os.chmod(os.path.join(specs, "svc.json"), 0o644)

    def sv(*args):
        return subprocess.run([SUPERVISE, *args, "svc"], capture_output=True, text=True,
                              timeout=60, env=env)

    def status():
        return json.loads(sv("status").stdout)

    try:
        assert sv("start").stdout.strip() == "svc: started"
        assert sv("start").stdout.strip() == "svc: already running"
        first = status()
        assert first["running"] and first["child_pid"] > 0
        with open(f"/proc/{first['child_pid']}/status") as f:
            proc_status = f.read()
        assert "NoNewPrivs:\t1" in proc_status
        assert f"Uid:\t{__import__('pwd').getpwnam('nobody').pw_uid}" in proc_status
        os.kill(first["child_pid"], 9)
        deadline = time.monotonic() + 15
        again = status()
        while time.monotonic() < deadline and not (again["running"] and again["child_pid"] != first["child_pid"]):
            time.sleep(0.1)
            again = status()
        assert again["running"] and again["child_pid"] != first["child_pid"], again
        assert again["restarts"] == 1 and again["last_exit"] == "killed by signal 9"
        assert sv("stop").stdout.strip() == "svc: stopped"
        assert sv("status").returncode == 3
        assert not os.path.exists(f"/proc/{again['child_pid']}")
        with open(log) as f:
            assert f.read().count("up hello") == 2
    finally:
        sv("stop")
        shutil.rmtree(work, ignore_errors=True)


def test_kiln_supervise_refuses_a_spec_others_may_write(tmp_path):
    specs = tmp_path / "specs"
    specs.mkdir()
    spec = specs / "svc.json"
    spec.write_text(json.dumps({"argv": ["/bin/true"]}))
    spec.chmod(0o666)
    proc = subprocess.run([SUPERVISE, "start", "svc"], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, KILN_SUPERVISE_SPECS=str(specs),
                                   KILN_SUPERVISE_RUN=str(tmp_path / "run")))
    assert proc.returncode != 0
    assert "writable by root only" in proc.stderr or "owned by root" in proc.stderr


@pytest.mark.skipif(not shutil.which("ansible-lint"), reason="ansible-lint is not installed")
def test_ansible_lint_passes_at_the_production_profile_offline(tmp_path):
    # A copy in a repository of its own: ansible-lint looks for the
    # project's root with git and writes its cache beside it.
    work = tmp_path / "ansible"
    shutil.copytree(ANSIBLE, work, ignore=shutil.ignore_patterns("pki", "artifacts", "*.retry"))
    subprocess.run(["git", "init", "-q", str(work)], check=True, timeout=60)
    proc = subprocess.run(["ansible-lint", "--offline", "--profile", "production", "--nocolor"],
                          cwd=work, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HOME=str(tmp_path), ANSIBLE_HOME=str(tmp_path / "home")))
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
