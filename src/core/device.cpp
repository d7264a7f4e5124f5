#include "core/device.h"

#include "core/error.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

namespace loom {

const char * device_type_name(DeviceType type) {
    return type == DeviceType::cpu ? "cpu" : "cuda";
}

bool streams_synchronous_from_env() {
    const char * value = std::getenv("LOOM_SYNC_STREAMS");
    return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

int64_t stream_delay_us_from_env(const std::string & stream_name) {
    const char * value = std::getenv("LOOM_STREAM_DELAY_US");
    if (value == nullptr || *value == '\0') return 0;
    std::stringstream entries(value);
    std::string       entry;
    int64_t           delay = 0;
    while (std::getline(entries, entry, ',')) {
        size_t eq = entry.find('=');
        LOOM_CHECK(eq != std::string::npos, "LOOM_STREAM_DELAY_US entry '" << entry << "' is not name=microseconds",
                   "for example LOOM_STREAM_DELAY_US=compute=200,ddp-comm=300");
        char *  end = nullptr;
        int64_t us  = std::strtoll(entry.c_str() + eq + 1, &end, 10);
        LOOM_CHECK(end != entry.c_str() + eq + 1 && *end == '\0' && us >= 0 && us <= 1000000,
                   "LOOM_STREAM_DELAY_US entry '" << entry << "' needs 0..1000000 microseconds", "");
        if (entry.compare(0, eq, stream_name) == 0 && eq == stream_name.size()) delay = us;
    }
    return delay;
}

std::string Device::name() const {
    return std::string(kind_name()) + ":" + std::to_string(index());
}

}  // namespace loom
