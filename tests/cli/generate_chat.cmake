cmake_minimum_required(VERSION 3.25)
# generate with a chat template: a JSONL line with "messages" and a text prompt with --chat are formatted
# with the run's data.chat_template (here chatml); the output line of a conversation carries "messages"
# (not "prompt"), and no completion keeps the end-of-turn marker. A "messages" list ending with an
# assistant turn is an error naming file:line.
# Usage: cmake -DNDTRAIN=bin -DRUN=dir -DOUT=prefix -P generate_chat.cmake
file(WRITE ${OUT}_in.jsonl
     "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"hi\"}]}\n"
     "{\"prompt\": \"hello\"}\n")
execute_process(COMMAND ${NDTRAIN} generate --run ${RUN} --input ${OUT}_in.jsonl --chat -n 24 --output ${OUT}.jsonl
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "generated 2 completions")
  message(FATAL_ERROR "generate --chat failed (${rc}):\n${out}\n${err}")
endif()
file(READ ${OUT}.jsonl text)
string(FIND "${text}" "\"messages\":[{\"content\":\"Be brief.\",\"role\":\"system\"}" conv)
string(FIND "${text}" "\"prompt\":\"hello\"" plain)
string(FIND "${text}" "<|im_end|>\"" marker)
if(conv LESS 0 OR plain LESS 0 OR NOT marker LESS 0)
  message(FATAL_ERROR "unexpected output (conversation at ${conv}, text prompt at ${plain}, marker at ${marker}):\n${text}")
endif()
file(WRITE ${OUT}_bad.jsonl "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}\n")
execute_process(COMMAND ${NDTRAIN} generate --run ${RUN} --input ${OUT}_bad.jsonl RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "_bad.jsonl:1: .messages. must be non-empty and not end with an assistant message")
  message(FATAL_ERROR "a conversation ending with the assistant was not refused (${rc}):\n${out}\n${err}")
endif()
message(STATUS "chat prompts formatted, markers stripped, bad conversation refused")
