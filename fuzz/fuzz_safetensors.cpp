// The safetensors reader: header validation, then every tensor read as f32.
#include "fuzz/fuzz_input.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = loom::fuzz::scratch_dir() + "/model.safetensors";
    loom::fuzz::write_file(path, data, size);
    try {
        loom::io::SafetensorsFile file(path);
        for (const loom::io::SafetensorsEntry & e : file.entries()) {
            if (e.end - e.begin <= (1u << 20)) {
                try {
                    file.read_f32(e.name);
                } catch (const loom::Error &) {   // a dtype that is not a float: refused per tensor
                }
            }
        }
    } catch (const loom::Error &) {
    }
    return 0;
}
