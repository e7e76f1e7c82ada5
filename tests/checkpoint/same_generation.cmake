cmake_minimum_required(VERSION 3.25)
# Greedy completions of two run directories must be identical (and non-empty).
# Usage: cmake -DNDTRAIN=bin -DA=run_a -DB=run_b -P same_generation.cmake
foreach(run A B)
  execute_process(COMMAND ${NDTRAIN} generate --run ${${run}} --prompt "the cat" --prompt "a dog" -n 12
                  OUTPUT_VARIABLE out_${run} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR out_${run} STREQUAL "")
    message(FATAL_ERROR "generate on ${${run}} failed (${rc})")
  endif()
endforeach()
if(NOT out_A STREQUAL out_B)
  message(FATAL_ERROR "completions differ:\n${out_A}\nvs\n${out_B}")
endif()
message(STATUS "same completions:\n${out_A}")
