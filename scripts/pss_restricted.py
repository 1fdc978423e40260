#!/usr/bin/env python3
"""Checks Kubernetes manifests against the Pod Security Standards' "restricted" level (which
includes "baseline"), as https://kubernetes.io/docs/concepts/security/pod-security-standards/
states it, plus this project's own rules (readOnlyRootFilesystem, a pinned image tag, memory
limits). Offline: it reads the YAML and applies the rules to every pod template (Pod, Job,
CronJob, Deployment, StatefulSet, DaemonSet, ReplicaSet).

    pss_restricted.py FILE...        exit 0: every pod passes; 1: the violations are printed

Needs PyYAML (kubernetes-validate brings it).
"""
import sys

import yaml

# baseline: capabilities a container may add (restricted narrows it to NET_BIND_SERVICE)
RESTRICTED_ADD = {"NET_BIND_SERVICE"}
# restricted: the only volume types
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret",
}
# baseline: sysctls allowed
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def pod_specs(doc):
    """(where, pod spec) of every pod a document makes."""
    kind = doc.get("kind")
    name = f"{kind}/{doc.get('metadata', {}).get('name')}"
    spec = doc.get("spec") or {}
    if kind == "Pod":
        yield name, spec
    elif kind in ("Job", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController"):
        yield name, (spec.get("template") or {}).get("spec") or {}
    elif kind == "CronJob":
        job = (spec.get("jobTemplate") or {}).get("spec") or {}
        yield name, (job.get("template") or {}).get("spec") or {}


def check_pod(where, pod):
    """The violations of one pod spec, as strings."""
    bad = []
    psc = pod.get("securityContext") or {}
    containers = [("container", c) for c in pod.get("containers") or []]
    containers += [("initContainer", c) for c in pod.get("initContainers") or []]
    containers += [("ephemeralContainer", c) for c in pod.get("ephemeralContainers") or []]
    if not pod.get("containers"):
        bad.append("no containers")
    # --- baseline
    for f in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(f):
            bad.append(f"{f}: true (baseline: host namespaces)")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        bad.append("windowsOptions.hostProcess (baseline)")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            bad.append(f"sysctl {s.get('name')} (baseline: unsafe sysctl)")
    for v in pod.get("volumes") or []:
        types = set(v) - {"name"}
        if "hostPath" in types:
            bad.append(f"volume {v.get('name')}: hostPath (baseline)")
        elif not types <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v.get('name')}: {sorted(types)} (restricted: volume types)")

    def selinux_ok(ctx, what):
        se = ctx.get("seLinuxOptions") or {}
        if se.get("type") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            bad.append(f"{what}: seLinuxOptions {se} (baseline)")

    def seccomp_type(ctx):
        return (ctx.get("seccompProfile") or {}).get("type")

    def apparmor_ok(ctx, what):
        t = (ctx.get("appArmorProfile") or {}).get("type")
        if t not in (None, "RuntimeDefault", "Localhost"):
            bad.append(f"{what}: appArmorProfile {t} (baseline)")

    selinux_ok(psc, "pod")
    apparmor_ok(psc, "pod")
    if seccomp_type(psc) == "Unconfined":
        bad.append("pod: seccompProfile Unconfined (baseline)")
    for anno, value in ((pod.get("metadata") or {}).get("annotations") or {}).items():
        if anno.startswith("container.apparmor.security.beta.kubernetes.io/") and value not in (
            "runtime/default", ) and not value.startswith("localhost/"):
            bad.append(f"annotation {anno}: {value} (baseline)")
    if psc.get("runAsUser") == 0:
        bad.append("pod: runAsUser 0 (restricted)")
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = seccomp_type(psc) in ("RuntimeDefault", "Localhost")
    for role, c in containers:
        what = f"{role} {c.get('name')}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            bad.append(f"{what}: privileged (baseline)")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            bad.append(f"{what}: windowsOptions.hostProcess (baseline)")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                bad.append(f"{what}: hostPort {p.get('hostPort')} (baseline)")
        if sc.get("procMount") not in (None, "Default"):
            bad.append(f"{what}: procMount {sc.get('procMount')} (baseline)")
        selinux_ok(sc, what)
        apparmor_ok(sc, what)
        if seccomp_type(sc) == "Unconfined":
            bad.append(f"{what}: seccompProfile Unconfined (baseline)")
        # --- restricted
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{what}: allowPrivilegeEscalation must be false (restricted)")
        if sc.get("runAsNonRoot") is False or not (pod_nonroot or sc.get("runAsNonRoot") is True):
            bad.append(f"{what}: runAsNonRoot must be true, on the pod or the container (restricted)")
        if sc.get("runAsUser") == 0:
            bad.append(f"{what}: runAsUser 0 (restricted)")
        if not (pod_seccomp or seccomp_type(sc) in ("RuntimeDefault", "Localhost")):
            bad.append(f"{what}: seccompProfile RuntimeDefault or Localhost required (restricted)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{what}: capabilities must drop ALL (restricted)")
        extra = set(caps.get("add") or []) - RESTRICTED_ADD
        if extra:
            bad.append(f"{what}: capabilities add {sorted(extra)} (restricted: only NET_BIND_SERVICE)")
        # --- this project's rules (not part of the standard)
        if role != "ephemeralContainer":
            if sc.get("readOnlyRootFilesystem") is not True:
                bad.append(f"{what}: readOnlyRootFilesystem must be true (project rule)")
            image = c.get("image") or ""
            tag = image.rsplit("/", 1)[-1]
            if "@sha256:" not in image and (":" not in tag or tag.endswith(":latest")):
                bad.append(f"{what}: image {image!r} is not pinned (project rule: a version tag or a digest)")
            if not ((c.get("resources") or {}).get("limits") or {}).get("memory"):
                bad.append(f"{what}: no memory limit (project rule)")
    return [f"{where}: {b}" for b in bad]


def main(paths):
    problems, pods = [], 0
    for path in paths:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if not doc:
                    continue
                for where, pod in pod_specs(doc):
                    pods += 1
                    problems += [f"{path}: {p}" for p in check_pod(where, pod)]
    for p in problems:
        print(p)
    print(f"pss_restricted: {pods} pod template(s) in {len(paths)} file(s), "
          f"{len(problems)} violation(s) of the restricted level or the project's rules")
    return 1 if problems or pods == 0 else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
