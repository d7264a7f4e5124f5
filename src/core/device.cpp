#include "core/device.h"

#include <cstdlib>
#include <cstring>

namespace loom {

const char * device_type_name(DeviceType type) {
    return type == DeviceType::cpu ? "cpu" : "cuda";
}

bool streams_synchronous_from_env() {
    const char * value = std::getenv("LOOM_SYNC_STREAMS");
    return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

std::string Device::name() const {
    return std::string(device_type_name(type())) + ":" + std::to_string(index());
}

}  // namespace loom
