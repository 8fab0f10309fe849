# The Cortex gateway image, from the repository root: `docker build -t cortex-gateway:0.1.0 .`
# No container engine runs on the project's machines, so this image is not built there;
# `cargo xtask deploy-check` checks what it can: the build command is CI's (`--locked`), the
# toolchain is rust-toolchain.toml's, the user is not root, the port is the manifests'.

# Build: the pinned toolchain, the release build of the lockfile CI tests.
FROM rust:1.95.0-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p cortex-gateway --bin cortex-gateway

# Run: Debian slim (glibc and libstdc++, which the bundled libzmq needs) and the binary; no
# tokenizers, templates or demo files (the models come from a volume, the config from a file).
FROM debian:bookworm-slim
COPY --from=build /src/target/release/cortex-gateway /usr/local/bin/cortex-gateway
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/cortex-gateway"]
CMD ["--config", "/etc/cortex/cortex.yaml"]
