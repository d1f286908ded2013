#version 450
#define WFMT 0
#extension GL_GOOGLE_include_directive : require
#include "mmt.glsl"
