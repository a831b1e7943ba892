"""The Pod Security Standards `restricted` profile as a check: `violations(pod)` lists every rule a pod breaks
(`[]` when it passes). Written from the published rules list (kubernetes.io/docs/concepts/security/
pod-security-standards, Baseline and Restricted tables, Linux pods), one function a control:

    Baseline    HostProcess, host namespaces, privileged, capabilities (add: the default set), hostPath volumes,
                host ports, AppArmor, SELinux, /proc mount type, seccomp (not Unconfined), sysctls (the safe set)
    Restricted  volume types, privilege escalation, running as non-root, non-root user (runAsUser != 0),
                seccomp (RuntimeDefault or Localhost, set), capabilities (drop ALL; add only NET_BIND_SERVICE)

Containers are `containers`, `initContainers` and `ephemeralContainers`; a container-level field overrides the
pod-level one where the rule says so (runAsNonRoot, seccompProfile).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Obj = dict[str, Any]

BASELINE_CAPABILITIES = {'AUDIT_WRITE', 'CHOWN', 'DAC_OVERRIDE', 'FOWNER', 'FSETID', 'KILL', 'MKNOD',
                         'NET_BIND_SERVICE', 'SETFCAP', 'SETGID', 'SETPCAP', 'SETUID', 'SYS_CHROOT'}
SAFE_SYSCTLS = {'kernel.shm_rmid_forced', 'net.ipv4.ip_local_port_range', 'net.ipv4.ip_unprivileged_port_start',
                'net.ipv4.tcp_syncookies', 'net.ipv4.ping_group_range', 'net.ipv4.ip_local_reserved_ports',
                'net.ipv4.tcp_keepalive_time', 'net.ipv4.tcp_fin_timeout', 'net.ipv4.tcp_keepalive_intvl',
                'net.ipv4.tcp_keepalive_probes'}
RESTRICTED_VOLUMES = {'configMap', 'csi', 'downwardAPI', 'emptyDir', 'ephemeral', 'persistentVolumeClaim',
                      'projected', 'secret'}
SELINUX_TYPES = {'', 'container_t', 'container_init_t', 'container_kvm_t', 'container_engine_t'}


def _containers(spec: Obj) -> Iterator[tuple[str, Obj]]:
    for field in ('initContainers', 'containers', 'ephemeralContainers'):
        for c in spec.get(field) or ():
            yield f'{field}[{c.get("name")}]', c


def _sc(obj: Obj) -> Obj:
    return obj.get('securityContext') or {}


def _host_process(spec: Obj) -> Iterator[str]:
    if ((_sc(spec).get('windowsOptions') or {}).get('hostProcess')):
        yield 'securityContext.windowsOptions.hostProcess must not be true'
    for where, c in _containers(spec):
        if (_sc(c).get('windowsOptions') or {}).get('hostProcess'):
            yield f'{where}: windowsOptions.hostProcess must not be true'


def _host_namespaces(spec: Obj) -> Iterator[str]:
    for field in ('hostNetwork', 'hostPID', 'hostIPC'):
        if spec.get(field):
            yield f'{field} must be unset or false'


def _privileged(spec: Obj) -> Iterator[str]:
    for where, c in _containers(spec):
        if _sc(c).get('privileged'):
            yield f'{where}: privileged must be unset or false'


def _capabilities(spec: Obj) -> Iterator[str]:
    for where, c in _containers(spec):
        caps = _sc(c).get('capabilities') or {}
        added = set(caps.get('add') or ())
        if added - BASELINE_CAPABILITIES:
            yield f'{where}: capabilities.add beyond the baseline set: {sorted(added - BASELINE_CAPABILITIES)}'
        if added - {'NET_BIND_SERVICE'}:
            yield f'{where}: capabilities.add may only hold NET_BIND_SERVICE: {sorted(added)}'
        if 'ALL' not in (caps.get('drop') or ()):
            yield f'{where}: capabilities.drop must include ALL'


def _volumes(spec: Obj) -> Iterator[str]:
    for volume in spec.get('volumes') or ():
        kinds = set(volume) - {'name'}
        if 'hostPath' in kinds:
            yield f'volume {volume["name"]}: hostPath volumes are forbidden'
        if kinds - RESTRICTED_VOLUMES:
            yield f'volume {volume["name"]}: type {sorted(kinds - RESTRICTED_VOLUMES)} is not allowed'


def _host_ports(spec: Obj) -> Iterator[str]:
    for where, c in _containers(spec):
        for port in c.get('ports') or ():
            if port.get('hostPort'):
                yield f'{where}: hostPort must be unset or 0'


def _apparmor(pod: Obj) -> Iterator[str]:
    spec = pod['spec']
    profiles = [('securityContext', _sc(spec).get('appArmorProfile'))]
    profiles += [(where, _sc(c).get('appArmorProfile')) for where, c in _containers(spec)]
    for where, profile in profiles:
        if profile and profile.get('type') not in ('RuntimeDefault', 'Localhost'):
            yield f'{where}: appArmorProfile.type must be RuntimeDefault or Localhost'
    for key, value in ((pod.get('metadata') or {}).get('annotations') or {}).items():
        if key.startswith('container.apparmor.security.beta.kubernetes.io/') and value != 'runtime/default' \
                and not value.startswith('localhost/'):
            yield f'annotation {key}: must be runtime/default or localhost/*'


def _selinux(spec: Obj) -> Iterator[str]:
    options = [('securityContext', _sc(spec).get('seLinuxOptions'))]
    options += [(where, _sc(c).get('seLinuxOptions')) for where, c in _containers(spec)]
    for where, opts in options:
        if not opts:
            continue
        if opts.get('type', '') not in SELINUX_TYPES:
            yield f'{where}: seLinuxOptions.type {opts["type"]!r} is not allowed'
        if opts.get('user') or opts.get('role'):
            yield f'{where}: seLinuxOptions.user and role must be unset'


def _proc_mount(spec: Obj) -> Iterator[str]:
    for where, c in _containers(spec):
        if _sc(c).get('procMount', 'Default') != 'Default':
            yield f'{where}: procMount must be unset or Default'


def _sysctls(spec: Obj) -> Iterator[str]:
    for sysctl in _sc(spec).get('sysctls') or ():
        if sysctl.get('name') not in SAFE_SYSCTLS:
            yield f'sysctl {sysctl.get("name")} is not in the safe set'


def _privilege_escalation(spec: Obj) -> Iterator[str]:
    for where, c in _containers(spec):
        if _sc(c).get('allowPrivilegeEscalation') is not False:
            yield f'{where}: allowPrivilegeEscalation must be false'


def _non_root(spec: Obj) -> Iterator[str]:
    pod_level = _sc(spec).get('runAsNonRoot')
    for where, c in _containers(spec):
        own = _sc(c).get('runAsNonRoot')
        if own is False or (own is None and pod_level is not True):
            yield f'{where}: runAsNonRoot must be true (pod or container)'


def _non_root_user(spec: Obj) -> Iterator[str]:
    if _sc(spec).get('runAsUser') == 0:
        yield 'securityContext.runAsUser must not be 0'
    for where, c in _containers(spec):
        if _sc(c).get('runAsUser') == 0:
            yield f'{where}: runAsUser must not be 0'


def _seccomp(spec: Obj) -> Iterator[str]:
    pod_level = (_sc(spec).get('seccompProfile') or {}).get('type')
    if pod_level == 'Unconfined':
        yield 'securityContext.seccompProfile.type must not be Unconfined'
    for where, c in _containers(spec):
        own = (_sc(c).get('seccompProfile') or {}).get('type')
        effective = own or pod_level
        if effective not in ('RuntimeDefault', 'Localhost'):
            yield f'{where}: seccompProfile.type must be RuntimeDefault or Localhost (pod or container)'


_SPEC_RULES = (_host_process, _host_namespaces, _privileged, _capabilities, _volumes, _host_ports, _selinux,
               _proc_mount, _sysctls, _privilege_escalation, _non_root, _non_root_user, _seccomp)


def violations(pod: Obj) -> list[str]:
    """Every `restricted` rule the pod breaks, one line each."""
    spec = pod['spec']
    return [v for rule in _SPEC_RULES for v in rule(spec)] + list(_apparmor(pod))
