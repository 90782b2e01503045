#!/bin/sh
# Compiles every *.comp in this folder to SPIR-V beside it, validates it, and
# records the source and SPIR-V digests in manifest.txt (checked by the tests).
set -eu
cd "$(dirname "$0")"
: > manifest.txt.new
for src in *.comp; do
	spv="${src%.comp}.spv"
	glslc -O --target-env=vulkan1.1 -o "$spv" "$src"
	spirv-val --target-env vulkan1.1 "$spv"
	printf '%s %s %s\n' "$(sha256sum < "$src" | cut -d' ' -f1)" "$(sha256sum < "$spv" | cut -d' ' -f1)" "$src" >> manifest.txt.new
done
printf '%s\n' "$(glslc --version | head -1)" > compiler.txt
mv manifest.txt.new manifest.txt
