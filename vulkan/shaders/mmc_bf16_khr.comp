#version 450
#define WFMT 2
#extension GL_GOOGLE_include_directive : require
#include "mmc.glsl"
