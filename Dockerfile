# A minimal image holding only the statically linked kube-apiserver-proxy binary.
#
#   docker build -t kube-apiserver-proxy .
#
# The binary is linked statically against glibc (crt-static), so it runs in an image with no
# libc at all; the init container of the kube-apiserver pod copies it into a shared emptyDir
# (see manifests/). It makes no DNS lookups: every address it takes is a literal ip:port.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --locked -p kube-apiserver-proxy --target x86_64-unknown-linux-gnu \
 && cp target/x86_64-unknown-linux-gnu/release/kube-apiserver-proxy /kube-apiserver-proxy

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /kube-apiserver-proxy /kube-apiserver-proxy
# The proxy's own uid (manifests/base/deployment.yaml sets it too): not distroless's `nonroot`
# 65532, which every distroless image shares.
USER 59443:59443
ENTRYPOINT ["/kube-apiserver-proxy"]
