// Umbrella header of the meshmem host API.
#pragma once

#include "meshmem/comm.hpp"
#include "meshmem/config.hpp"
#include "meshmem/error.hpp"
#include "meshmem/halo.hpp"
