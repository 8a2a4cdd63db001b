# The versions the real-cluster tier builds and runs, in one place: sourced by run, prepare
# and node/smoke (whose environment variables KUBELET_VERSION and the rest still override
# them there). Each has its wrapper module under build/ (or node/ for the CNI plugins): change
# both together.
# shellcheck shell=bash
kap_kube_version=v1.37.2      # kube-apiserver, kubeadm, kubelet, controller-manager, scheduler, kube-proxy
kap_kube_old_version=v1.36.3  # the image change, the upgrade scenario, `kubeadm init` of --kubeadm-upgrade
kap_etcd_version=v3.6.16      # the etcd every control plane starts with
kap_etcd_next_version=v3.7.0  # the etcd kubeadm $kap_kube_version upgrades to (--kubeadm-upgrade)
kap_containerd_version=v2.2.9
kap_runc_version=v1.3.6
kap_cni_version=v1.10.0
# One set of Go build settings for every Go build of the tier (its commands, `go test`, the
# components, the node's binaries): the builds share Go's build cache only when they agree,
# and a cold run compiles client-go's tree once instead of once per setting.
export CGO_ENABLED=0 GOFLAGS=-trimpath
