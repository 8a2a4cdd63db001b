# shellcheck shell=bash
# shellcheck disable=SC2154 # S and CTR come from smoke, which sources this
# The node actions of the lifecycle rehearsals (`smoke --lifecycle`, tests/cluster/internal/node's
# RunLifecycle, driven by smoke's `drive lifecycle`): what only the node's owner does.

# node_image_import TAR: the image (the slow start's apiserver) imported into the node's
# containerd, where the kubelet finds it.
node_image_import() {
  "${CTR[@]}" images import "$1" >>"$S/image-import.log" 2>&1
}
