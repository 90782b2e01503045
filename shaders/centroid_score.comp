#version 450
// centroid_score.glsl with DOT = 0 (see there).
#extension GL_GOOGLE_include_directive : require
#define DOT 0
#include "centroid_score.glsl"
