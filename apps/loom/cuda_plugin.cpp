// cuda_backend() (gpu_backend.h): the CUDA backend lives in a plugin, libloom_cuda.so beside the loom
// executable (or the file LOOM_CUDA_PLUGIN names), loaded with dlopen the first time a run asks for it.
// The executable itself needs no CUDA library, so one binary runs on machines without them, and a CPU run
// never maps them. A build without the CUDA toolkit has no plugin: cuda_backend() is then nullptr.
#include "apps/loom/gpu_backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <string>

namespace loom::app {

namespace {

std::string & load_error() {
    static std::string error;
    return error;
}

#ifdef LOOM_WITH_CUDA_PLUGIN
std::string plugin_path() {
    if (const char * path = std::getenv("LOOM_CUDA_PLUGIN"); path != nullptr && *path != '\0') return path;
    char    self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n <= 0) return "libloom_cuda.so";
    std::string dir(self, static_cast<size_t>(n));
    return dir.substr(0, dir.rfind('/') + 1) + "libloom_cuda.so";
}

const GpuBackend * load() {
    const std::string path   = plugin_path();
    void *            handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
        const char * why = dlerror();
        load_error()     = "the CUDA backend " + path + " could not be loaded: " + (why ? why : "unknown error");
        return nullptr;
    }
    using Entry  = const GpuBackend * (*)();
    auto entry   = reinterpret_cast<Entry>(dlsym(handle, "loom_cuda_backend"));
    if (entry == nullptr) {
        load_error() = "the CUDA backend " + path + " has no entry point loom_cuda_backend";
        return nullptr;
    }
    return entry();   // the handle stays open for the life of the process
}
#endif

}  // namespace

const GpuBackend * cuda_backend() {
#ifdef LOOM_WITH_CUDA_PLUGIN
    static const GpuBackend * backend = load();
    return backend;
#else
    load_error() = "this loom was built without the CUDA backend";
    return nullptr;
#endif
}

std::string cuda_backend_error() { return load_error(); }

bool nvidia_driver_present() { return access("/proc/driver/nvidia/version", F_OK) == 0 || access("/dev/nvidiactl", F_OK) == 0; }

}  // namespace loom::app
