// error_of(f): runs f, expects a loom::Error, and returns its whole text (message and hint), so a test
// can check that the message names the file, flag or value at fault.
#pragma once

#include "core/error.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace loom {

inline std::string error_of(const std::function<void()> & f) {
    try {
        f();
    } catch (const Error & e) {
        return e.what();
    }
    ADD_FAILURE() << "no loom::Error thrown";
    return "";
}

}  // namespace loom
